"""`mhla generate teacher | assoc`: synthetic tokens files with targets."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

import typer

from ..model import synthetic
from ..errors import InputError
from ..model.export import save_heads
from ..feature_map import check_normalize
from ..samples import ReadSpec, samples_of
from .console import emit_json, say
from .help import HelpGroup
from .options import AttentionOpt, JsonOpt, NormalizeOpt, OutOpt, QuietOpt, check_hdf5_output, check_heads_output


generate_app = typer.Typer(help="Make synthetic datasets (tokens files with targets).", no_args_is_help=True,
                           cls=HelpGroup)


@generate_app.command("teacher")
def generate_teacher_cmd(
    output: OutOpt,
    dim: Annotated[int, typer.Option("--dim", min=1, help="Token dimension d.")],
    heads: Annotated[int, typer.Option("--heads", min=1, help="Number of teacher heads H.")],
    n_samples: Annotated[int, typer.Option("--n-samples", min=1, help="Number of sequences N.")],
    seq_len: Annotated[str, typer.Option("--seq-len", help="Sequence length n, or MIN:MAX for ragged lengths.")] = "100",
    noise: Annotated[float, typer.Option("--noise", min=0.0, help="Std of Gaussian label noise.")] = 0.0,
    seed: Annotated[int, typer.Option("--seed", help="Random seed.")] = 0,
    teacher_out: Annotated[Path | None, typer.Option("--teacher-out", help="Also write the teacher as a heads file "
                                              "(HDF5, or .npz / .safetensors by the suffix, as export-heads).")] = None,
    dtype: Annotated[Literal["float32", "float64"], typer.Option("--dtype", help="Stored dtype.")] = "float32",
    per_position: Annotated[bool, typer.Option("--per-position", help="Targets at every position (T, d): the "
                                               "teacher's output on every prefix (autoregressive data), or with "
                                               "--attention bidirectional at every position with the whole "
                                               "sequence's S (an encoder's).")] = False,
    normalize: NormalizeOpt = None,
    attention: AttentionOpt = None,
    bias: Annotated[bool, typer.Option("--bias", help="A teacher whose heads have biases (docs/bias_terms.md): head h "
                                       "outputs sum_i (V_h x_i + b_v) (x_i^T Q_h x_t + c . x_i + r . x_t + z); "
                                       "`--bias-terms` fits it exactly, the MHLA alone does not.")] = False,
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """Gaussian tokens labelled by a random H-head MHLA teacher (outputs scaled to RMS 1).

    Example: mhla generate teacher -o data.h5 --dim 4 --heads 2 --n-samples 2048 --seq-len 100 --teacher-out teacher.h5

    Example (causal): mhla generate teacher -o ar.h5 --dim 3 --heads 2 --n-samples 10 --seq-len 5:40 --per-position

    Example (bidirectional): mhla generate teacher -o enc.h5 --dim 3 --heads 2 --n-samples 50 --seq-len 4:12
    --per-position --attention bidirectional

    Example (heads with biases): mhla generate teacher -o b.h5 --dim 3 --heads 2 --n-samples 400 --seq-len 2:9 --bias
    """
    if attention is not None and not per_position:
        raise InputError("--attention applies to per-position targets: add --per-position")
    if dtype not in ("float32", "float64"):
        raise InputError(f"--dtype must be float32 or float64, got {dtype}")
    norm = check_normalize(normalize or "none")
    check_hdf5_output(output, (), "a tokens file", "tokens")
    if teacher_out is not None:
        check_heads_output(teacher_out)
        if Path(teacher_out).resolve() == Path(output).resolve():
            raise InputError("--teacher-out must differ from -o", teacher_out)
    ds, teacher = synthetic.generate_teacher(dim, heads, n_samples, seq_len, noise, seed, dtype=dtype,
                                             read=ReadSpec(samples_of(per_position, attention),
                                                           normalize=norm, bias_terms=bias))
    attrs = {"generator": "teacher", "seed": seed, "noise": noise, "n_heads": heads,
             "per_position": int(per_position), "normalize": norm}
    if bias:
        attrs["bias"] = 1
    ds.save(output, dtype=dtype, attrs=attrs)
    if teacher_out is not None:
        save_heads(teacher, teacher_out)  # HDF5, .npz or .safetensors by the suffix
    summary = {"output": str(output), "n_samples": ds.n_samples, "d": dim, "n_tokens": int(ds.offsets[-1]),
               "n_heads": heads, "teacher": str(teacher_out) if teacher_out else None,
               "per_position": per_position, "attention": ds.attention, "normalize": norm, "bias": bias}
    say(f"wrote {output}: N = {ds.n_samples} sequences, d = {dim}, {summary['n_tokens']} tokens"
        + (f"; teacher ({heads} heads" + (" with biases" if bias else "") + f") in {teacher_out}"
           if teacher_out else ""), quiet)
    if json_out:
        emit_json(summary)


@generate_app.command("assoc")
def generate_assoc_cmd(
    output: OutOpt,
    keys: Annotated[int, typer.Option("--keys", min=1, help="Number of key/value pairs k (token dim 2k).")],
    n_samples: Annotated[int, typer.Option("--n-samples", min=1, help="Number of sequences N.")],
    orthogonal_fraction: Annotated[float, typer.Option("--orthogonal-fraction", min=0.0, max=1.0,
                                                       help="Share of samples with orthogonal keys/values.")] = 0.0,
    seed: Annotated[int, typer.Option("--seed", help="Random seed.")] = 0,
    teacher_out: Annotated[Path | None, typer.Option("--teacher-out", help="Also write the exact 1-head teacher "
                                              "(a heads file: HDF5, or .npz / .safetensors by the suffix).")] = None,
    dtype: Annotated[Literal["float32", "float64"], typer.Option("--dtype", help="Stored dtype.")] = "float32",
    json_out: JsonOpt = False,
    quiet: QuietOpt = False,
) -> None:
    """The paper's associative memory: rows (k_j, v_j) then (q, 0); target (0, sum_j <q,k_j> v_j).

    Example: mhla generate assoc -o assoc.h5 --keys 4 --n-samples 16384 --orthogonal-fraction 1.0
    """
    if dtype not in ("float32", "float64"):
        raise InputError(f"--dtype must be float32 or float64, got {dtype}")
    check_hdf5_output(output, (), "a tokens file", "tokens")
    if teacher_out is not None:
        check_heads_output(teacher_out)
        if Path(teacher_out).resolve() == Path(output).resolve():
            raise InputError("--teacher-out must differ from -o", teacher_out)
    ds, teacher = synthetic.generate_assoc(keys, n_samples, orthogonal_fraction, seed, dtype=dtype)
    ds.save(output, dtype=dtype, attrs={"generator": "assoc", "seed": seed,
                                        "orthogonal_fraction": orthogonal_fraction, "keys": keys})
    if teacher_out is not None:
        save_heads(teacher, teacher_out)
    say(f"wrote {output}: N = {ds.n_samples} associative-memory sequences, k = {keys}, d = {2 * keys}", quiet)
    if json_out:
        emit_json({"output": str(output), "n_samples": ds.n_samples, "d": 2 * keys, "keys": keys,
                   "orthogonal_fraction": orthogonal_fraction,
                   "teacher": str(teacher_out) if teacher_out else None})


def register(app: typer.Typer) -> None:
    app.add_typer(generate_app, name="generate")
