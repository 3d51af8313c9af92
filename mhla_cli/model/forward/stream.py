"""Predictions streamed over a tokens file (`predict_file`): chunks of sequences, local workers or any map,
the device, the affine map of the wide tokens read in lockstep, the output file written atomically, and
the scores (MSE, R^2) against last-token or per-position targets."""

from __future__ import annotations

import dataclasses
import os
import threading
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

import h5py
import numpy as np

from mhla_cli.io import formats
from mhla_cli.linalg.device import check_device, worker_device
from mhla_cli.errors import InputError, Refused
from mhla_cli.feature_map import check_normalize
from mhla_cli.model.heads import Heads
from mhla_cli.model.model import Model, affine_of, bias_terms_of, normalize_of
from mhla_cli.statistics.affine_sums import WideSource
from mhla_cli.statistics.distributed.parallel import SerialMap, ThreadMap, make_map
from mhla_cli.model.scores import Spread
from mhla_cli.samples import BIDIRECTIONAL, CAUSAL, LAST, Samples
from mhla_cli.statistics.ranges import default_chunk_size
from mhla_cli.io.tokens import TokensInfo, check_finite, check_weights, inspect_tokens, iter_chunks, read_as, chunk_ranges, with_bias_terms
if TYPE_CHECKING:
    from mhla_cli.model.heads_sum import HeadsSum
from mhla_cli.model.forward.evaluate import DIRECT_CHUNK_BYTES, HeadsFn, evaluated, fitted_samples, function_of, in_basis, in_width, out_width, predict_chunk, sample_outputs



def scored(pred: np.ndarray, targets: np.ndarray, weights: np.ndarray | None) -> tuple[int, Spread]:
    """(#{i: w_i > 0}, the Spread of the targets with the squared error of `pred`: sum_i w_i ||pred_i -
    y_i||^2, scale-free) over the rows (B, d); w_i = 1 without weights."""
    count = targets.shape[0] if weights is None else int((weights > 0).sum())
    return count, Spread.of(targets, weights, err=np.asarray(pred, dtype=np.float64) - targets)


def positions_range(coef: np.ndarray | HeadsFn, info: Any, samples: Samples, normalize: str, sample_range: tuple[int, int],
                   progress: Callable[[int], None] | None = None, basis: np.ndarray | None = None,
                   affine: tuple[WideSource, np.ndarray] | None = None
                   ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, Spread]:
    """Outputs at every position of samples [lo, hi) in the layout `samples` (CAUSAL or BIDIRECTIONAL:
    `sample_outputs`): (pred (B, d), outputs (t, d), offsets, count, the scored targets' Spread: their
    weight, spread and weighted SSE, for the MSE and R^2). pred is the output at each sequence's last
    position (its last-token output in either layout).

    The SSE is sum_t w_t ||out_t - y_t||^2 over positions with w_t > 0 (per-position targets) or
    over sequences (last-token targets, pred vs y); count is the number of those samples, weight
    the sum of their weights. `basis`: the tokens X basis are evaluated (Model.evaluation).
    `progress(n)`, if given, is told the sequences done as the blocks of `sample_outputs` finish (they
    sum to hi - lo).
    """
    done = [0]

    def step(k: int) -> None:
        progress(k - done[0])  # type: ignore[misc]  # progress: not None where step is used
        done[0] = k

    lo, hi = sample_range
    for a, _b, tokens, offsets, targets, weights in iter_chunks(info, (lo, hi), hi - lo, prefetch=False,
                                                                with_weights=True):
        check_finite(tokens, offsets, targets, a, info.path)
        check_weights(weights, offsets, a, info.per_position, info.path)
        outputs = sample_outputs(coef, in_basis(tokens, basis), offsets, samples, normalize,
                                 progress=None if progress is None else step)
        if affine is not None:  # the affine map of the wide tokens at every position
            outputs = outputs + _affine_range(affine, a, offsets)
        pred = outputs[offsets[1:] - 1]
        count, spread = 0, Spread()
        if targets is not None:
            count, spread = scored((outputs if info.per_position else pred), targets, weights)
        return pred, outputs, offsets.copy(), count, spread
    raise ValueError("empty sample range")


def _affine_range(affine: tuple[WideSource, np.ndarray], a: int, offsets: np.ndarray) -> np.ndarray:
    """The affine map (d_out, D + 1) of the wide tokens at every token of the range starting at sample `a` with
    `offsets` (T, d_out), read from the wide source in lockstep."""
    wide, C = affine
    sample_range = (a, a + offsets.size - 1)
    chunk = next(wide.chunks(sample_range, sample_range[1] - sample_range[0], prefetch=False))
    out: np.ndarray = wide.rows(chunk, a, offsets, CAUSAL) @ C.T
    return out


def causal_range(coef: np.ndarray | HeadsFn, info: Any, normalize: str, sample_range: tuple[int, int],
                progress: Callable[[int], None] | None = None, basis: np.ndarray | None = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, int, Spread]:
    """`positions_range` of CAUSAL samples (the prefix outputs of `predict --causal`)."""
    return positions_range(coef, info, CAUSAL, normalize, sample_range, progress, basis)


def _one_at_a_time(progress: Callable[[int], None]) -> Callable[[int], None]:
    """`progress` for worker threads: one call at a time, and never again once it raised (an interrupt)."""
    lock, raised = threading.Lock(), list[bool]()

    def call(n: int) -> None:
        with lock:
            if raised:
                return
            try:
                progress(n)
            except BaseException:
                raised.append(True)
                raise
    return call


def _check_capture(fn: Model | Heads, data: str | os.PathLike) -> None:
    """A model or heads fitted on activations captured with TransformerLens's compatibility mode on (a model's data
    identity records it, formats.source_identity; heads their attribute formats.COMPAT_ATTR) are refused on tokens
    recorded with it off, and the reverse."""
    source = fn.info.get("data_source")
    fitted = source.get("compatibility_mode") if isinstance(source, dict) else fn.info.get(formats.COMPAT_ATTR)
    have = formats.recorded_compatibility_mode(data) if fitted is not None else None
    if have is not None and have != fitted:
        where = f" ({source.get('name', '?')})" if isinstance(source, dict) else ""
        raise InputError(f"the {'model was' if isinstance(fn, Model) else 'heads were'} fitted on activations "
                         f"captured with TransformerLens's compatibility mode {fitted}{where}, these with it {have}: "
                         "the two modes' activations differ (hook_z by the value bias); capture them the same way",
                         data)


def function_and_data(fn: Model | Heads, data: str | os.PathLike
                       ) -> tuple[np.ndarray | HeadsFn, str, TokensInfo]:
    """coef (own coordinates; or a HeadsFn) and normalisation of `fn`, and the layout of the tokens file
    `data` (same d checked, and the targets' width against the outputs')."""
    coef = function_of(fn)
    normalize = check_normalize(normalize_of(fn))
    info = inspect_tokens(data)
    _check_capture(fn, data)
    _check_not_reduced(fn, info.d, data)
    if bias_terms_of(fn):  # the function of the tokens (x, 1): the reader appends the constant
        info = with_bias_terms(info, pad_targets=False)
    if info.d != in_width(coef):  # the widths the user knows: the bias terms' constant coordinate not counted
        raise InputError(f"the data have d = {info.stored_d} but the model has d = "
                         f"{in_width(coef) - int(info.constant)}", data)
    if info.has_targets and info.out_dim != out_width(coef):
        raise Refused(f"the targets are {info.out_dim} wide but the model's outputs {out_width(coef)}: map the "
                      "targets as the model's were ({like_reduced})", data, like_reduced={})
    return coef, normalize, info


@dataclasses.dataclass
class Predictions:
    """What `predict_file` returns: the counts, and the MSE / R^2 when the data have targets it scores;
    the arrays only when nothing was written (`out` None). `to_dict` is the `mhla predict --json` record
    (without `output`)."""

    n_samples: int
    d: int
    normalize: str
    predictions: np.ndarray | None = dataclasses.field(default=None, repr=False)  # (N, d), without `out`
    outputs: np.ndarray | None = dataclasses.field(default=None, repr=False)  # (T, d): all_positions / causal
    offsets: np.ndarray | None = dataclasses.field(default=None, repr=False)  # (N + 1,) of `outputs`
    mse: float | None = None
    r2: float | None = None  # None also when the scored targets do not vary (mhla_cli.model.scores)
    n_scored: int | None = None  # None: no targets scored (and no mse / r2)
    # what was scored: "sequences" (last-token targets), or the per-position targets as "causal" (every prefix's
    # output) or "bidirectional" (every position's with the whole window's S); None with n_scored
    scored_as: str | None = None

    def __repr__(self) -> str:
        score = "" if self.n_scored is None else f", mse={self.mse:.4g}, r2={self.r2}, n_scored={self.n_scored}"
        return f"Predictions(n_samples={self.n_samples}, d={self.d}, normalize={self.normalize!r}{score})"

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"n_samples": self.n_samples, "d": self.d, "normalize": self.normalize}
        if self.predictions is not None:
            out["predictions"] = self.predictions
        if self.outputs is not None:
            out["outputs"], out["offsets"] = self.outputs, self.offsets
        if self.n_scored is not None:
            out.update(mse=self.mse, r2=self.r2, n_scored=self.n_scored, scored_as=self.scored_as)
        return out


def _predict_chunk_size(coef: np.ndarray | HeadsFn, info: TokensInfo, chunk_size: int | None) -> int:
    """The chunk of `predict_file`: the streaming default, or for heads evaluated directly one whose
    per-sequence S (B, d, d) and outputs stay within DIRECT_CHUNK_BYTES."""
    if chunk_size:
        return chunk_size
    if isinstance(coef, HeadsFn):
        # per sequence: its S (r, r) and reduced tokens (r each), its tokens as read and its outputs (factored
        # heads: the wide tokens, the reduced ones and the outputs of both widths)
        mean_len = max(1.0, info.n_tokens / info.n_samples)
        r, r_out = int(coef[1].shape[1]), int(coef[0].shape[1])
        wide = 0 if coef[2] is None else in_width(coef) + out_width(coef)
        per_seq = 8 * (r * (r + mean_len) + mean_len * (r_out + wide))
        return int(max(1, min(info.n_samples, DIRECT_CHUNK_BYTES // per_seq)))
    return default_chunk_size(info)


def _sinks(target: h5py.File | None, info: TokensInfo, d: int, with_outputs: bool) -> tuple[Any, Any, Any]:
    """Where the ranges' (predictions, outputs, offsets) go: datasets of the output file `target`, or arrays
    (None for the outputs without `with_outputs`); both take slice assignment."""
    if target is None:
        return (np.empty((info.n_samples, d)), np.empty((info.n_tokens, d)) if with_outputs else None,
                np.zeros(info.n_samples + 1, dtype=np.int64) if with_outputs else None)
    dp = target.create_dataset("predictions", (info.n_samples, d), dtype="f8")
    if not with_outputs:
        return dp, None, None
    do = target.create_dataset("outputs", (info.n_tokens, d), dtype="f8")
    doff = target.create_dataset("offsets", (info.n_samples + 1,), dtype="i8")
    doff[0] = 0
    return dp, do, doff


def _predict_ranges(task: Callable[[tuple[int, int]], tuple], todo: list[tuple[int, int]], pmap: Any,
                   sinks: tuple[Any, Any, Any], progress: Callable[[int], None] | None
                   ) -> tuple[int, Spread]:
    """Run `task` over the sample ranges `todo` with `pmap`, writing each range's rows into `sinks` in order
    (`_sinks`); the summed count and merged Spread (with the SSE). `progress(n)` is told each range's samples."""
    count, spread = 0, Spread()
    dp, do, doff = sinks
    tok_pos = 0
    for (a, b), (pred, outputs, offsets, part_n, part_spread) in zip(todo, pmap(task, todo)):
        count += part_n
        spread = spread.merge(part_spread)
        dp[a:b] = pred
        if do is not None:
            do[tok_pos:tok_pos + outputs.shape[0]] = outputs
            doff[a + 1:b + 1] = tok_pos + offsets[1:]
        tok_pos += int(offsets[-1])
        if progress is not None:
            progress(b - a)
    return count, spread


def _range_task(coef: np.ndarray | HeadsFn, info: TokensInfo, pmap: Any, normalize: str, samples: Samples | None,
               device: str | None, basis: np.ndarray | None,
               progress: Callable[[int], None] | None, affine: tuple[WideSource, np.ndarray] | None = None
               ) -> tuple[Callable[[tuple[int, int]], tuple], bool]:
    """The per-range task of `predict_file` under `pmap` (outputs at every position of `samples`, or None:
    the last-token predictions only), and whether it tells `progress` itself (its blocks as they finish)
    rather than `_predict_ranges` each range as it comes back."""
    # workers open the file themselves: give them an absolute path
    winfo = info if pmap.n_workers == 1 else dataclasses.replace(info, path=os.path.abspath(info.path))
    if affine is not None and pmap.n_workers > 1:
        w = affine[0]
        affine = (dataclasses.replace(w, info=dataclasses.replace(w.info, path=os.path.abspath(w.info.path))),
                  affine[1])
    if samples is None:
        return partial(predict_range, coef, winfo, None, normalize=normalize, device=device, basis=basis,
                       affine=affine), False
    # outputs at every position take long per range: in this process (serial or threads; `progress` None
    # for a caller's map) each range tells its blocks as they finish, one call at a time
    ticks = progress is not None and isinstance(pmap, (SerialMap, ThreadMap))
    return partial(positions_range, coef, winfo, samples, normalize,
                   progress=_one_at_a_time(progress) if ticks and progress is not None else None, basis=basis, affine=affine), ticks


def _write_predictions(out: str | os.PathLike, inputs: tuple[str | os.PathLike, ...], meta: dict[str, Any],
                       run: Callable[[h5py.File], Any]) -> Any:
    """`run(file)` on a new predictions file written atomically at `out` (its header naming `inputs`,
    the data first, and the attributes `meta`); what run returns."""
    formats.check_hdf5_suffix(out, "a predictions file")
    o = formats.check_output_path(out, inputs, "predictions")
    with formats.atomic_path(o) as tmp:
        with formats.create_output(tmp) as fout:
            for k, v in {**formats.header("predictions", inputs), **meta}.items():
                fout.attrs[k] = v
            return run(fout)


def predict_file(fn: Model | Heads | HeadsSum, data: str | os.PathLike, out: str | os.PathLike | None = None,
                 all_positions: bool = False, chunk_size: int | None = None,
                 progress: Callable[[int], None] | None = None,
                 inputs: tuple[str | os.PathLike, ...] = (), workers: int = 1,
                 map: Callable[..., Any] | None = None,  # noqa: A002
                 causal: bool = False, device: str | None = None,
                 affine_from: str | os.PathLike | None = None, layout: Samples | None = None) -> Predictions:
    """Stream predictions over a tokens file; write them to `out` (atomically) if given.

    Returns a summary (n_samples, mse and r2 when the data have targets: mhla_cli.model.scores, weighted like
    the MSE, None when the targets do not vary); without `out` the summary also
    holds the `predictions` array (and `outputs`, `offsets` with `all_positions` or `causal`).
    `workers=K` predicts chunks in K local workers (or pass any ordered `map`); the output is the
    same as the serial one. The model's normalisation (attribute `normalize`) is applied.

    `layout` (a per-position layout, mhla_cli.samples): `outputs` holds the output at every sample of that layout,
    scored against per-position targets (data whose `attention` attribute says another layout are refused); a model
    fitted on a layout that `predicts_every_position` takes no other. `causal` is layout=CAUSAL:
    `outputs` (T, d) holds the last-token output of every prefix X[:t] and `predictions`
    the one of every whole sequence; the MSE is over the weighted positions of per-position
    targets (sum w ||e||^2 / (d sum w)), or over the sequences of last-token targets. A model fitted
    on bidirectional samples (its `attention`, `fitted_samples`) writes `outputs` at every position
    with the whole window's S and scores them the same way (`causal` is then refused, and so are data
    whose `attention` attribute says causal); `all_positions` writes those outputs for any model
    (a model's own layout's, for a layout that `predicts_every_position`, mhla_cli.samples) and scores
    them against per-position targets of an encoder's windows (the file's `attention` bidirectional, or
    no attribute), not against those marked causal (every prefix's output: `causal` scores them).
    Last-token targets with `weights` (N,) give the same weighted MSE with or without `causal`:
    sum_i w_i ||yhat_i - y_i||^2 / (d sum_i w_i) (fit's train_mse), `n_scored` = #{i: w_i > 0};
    weight-0 sequences are predicted but not scored. Per-position targets of a last-token (or causal) model
    without `causal` or `all_positions` give no MSE (the predictions are per sequence). `scored_as` says
    what was scored.
    `device` (mhla_cli.linalg.device): the last-token predictions on a torch device (float64).
    A function with the token-wise affine map of the wide tokens (mhla_cli.solve.affine_block) reads them from
    `affine_from`, the tokens file `mhla reduce` read to make `data` (checked), or from `data` itself when its
    tokens are that wide (heads put back in the model's coordinates by `export-heads --unreduce`).
    A sum of blocks (mhla_cli.model.heads_sum.HeadsSum) writes its outputs in the layout it was fitted on
    (`_predict_sum_file`).
    """
    device = check_device(device, data)
    if not isinstance(fn, (Model, Heads)):
        if causal or all_positions or affine_from is not None or device is not None or layout not in (None, fn.layout):
            raise InputError("a sum of blocks is evaluated on the CPU in the layout it was fitted on, its affine map "
                             "on the tokens themselves: no causal, all_positions, layout, device or affine_from")
        return _predict_sum_file(fn, data, out, chunk_size, progress, (*inputs,), workers, map)
    affine = _affine_source(fn, data, affine_from)
    layout, fitted, samples = _output_layout(fn, layout, causal, all_positions)
    _, normalize, info = function_and_data(fn, data)
    coef, A = evaluated(fn)  # evaluated where it was solved (Model.evaluation), or the heads directly
    d = out_width(coef)
    info, scored_as = _scored_info(info, layout, fitted, samples)
    if isinstance(coef, HeadsFn):
        device = None  # heads evaluated directly run on the CPU
    todo = chunk_ranges(0, info.n_samples, _predict_chunk_size(coef, info, chunk_size))
    with_outputs = samples is not None

    def run(target: h5py.File | None) -> tuple[tuple[Any, Any, Any], tuple[int, Spread]]:
        sinks = _sinks(target, info, d, with_outputs)
        with make_map(workers=workers, map=map) as pmap:
            task, ticks = _range_task(coef, info, pmap, normalize, samples, device, A,
                                     progress if map is None else None, affine)
            return sinks, _predict_ranges(task, todo, pmap, sinks, None if ticks else progress)

    if out is not None:
        meta = {"d": d, "n_samples": info.n_samples, "normalize": normalize, CAUSAL.name: int(layout == CAUSAL)}
        if samples is not None:
            meta.update(samples.fit_attrs())  # what the outputs at every position are
        _, (count, spread) = _write_predictions(out, (data, *inputs), meta, run)
        result = Predictions(info.n_samples, d, normalize)
    else:
        (pred, outs, offs), (count, spread) = run(None)
        result = Predictions(info.n_samples, d, normalize, predictions=pred, outputs=outs, offsets=offs)
    if info.has_targets:
        result.scored_as = scored_as or "sequences"
        # weighted means over the scored samples' weights (sum w: units-free), the squares in the targets'
        # own scale (mhla_cli.model.scores.Spread: R^2 at any scale of the targets)
        result.mse = spread.mse(d)
        result.r2 = spread.r2()  # None when the scored targets do not vary (mhla_cli.model.scores)
        result.n_scored = count
    return result


def _output_layout(fn: Model | Heads, layout: Samples | None, causal: bool, all_positions: bool
                   ) -> tuple[Samples | None, Samples, Samples | None]:
    """The layout asked (None: the last-token outputs), the one `fn` was fitted on, and the layout of the outputs
    at every position (None: none): the one asked (of the prefixes with causal), the whole window's
    (all_positions), or the one the model was fitted on; the combinations that contradict one another refused."""
    if all_positions and causal:
        raise InputError("causal and all_positions cannot be combined: causal is the masked (prefix) "
                         "output at every position, all_positions the unmasked one")
    if (causal or all_positions) and layout not in (None, CAUSAL if causal else BIDIRECTIONAL):
        raise InputError(f"the layout {layout} was asked beside causal or all_positions: give one of them")
    layout = CAUSAL if causal else layout
    if layout is not None and not layout.per_position:
        layout = None  # the last-token outputs: the predictions themselves
    fitted = fitted_samples(fn)
    if layout is not None and fitted.predicts_every_position and layout != fitted:
        raise Refused(f"the model was fitted on {fitted.name} samples ({fitted.words}): "
                      f"{'{causal_flag}' if layout == CAUSAL else layout.name} would evaluate it on {layout.words}; "
                      f"its outputs at every position are written without {'{causal_flag}' if causal else 'a layout'}",
                      causal_flag={})
    samples = (layout if layout is not None else BIDIRECTIONAL if all_positions and not fitted.predicts_every_position
               else fitted if fitted.predicts_every_position else None)
    return layout, fitted, samples


def _scored_info(info: TokensInfo, layout: Samples | None, fitted: Samples, samples: Samples | None
                 ) -> tuple[TokensInfo, str | None]:
    """The data as scored, and the attention their per-position targets are scored in (None: per sequence).

    Per-position targets are scored against the outputs at every position: always in the layout asked or fitted
    on (data marked with another attention: refused); with all_positions when the targets are of an encoder's
    window (the file's attribute that layout's, or none), not against a decoder's prefixes (another attribute).
    """
    if info.per_position and samples is not None and (
            layout is not None or fitted.predicts_every_position or info.attention in (None, samples.attention)):
        return read_as(info, samples), samples.attention
    if info.per_position:
        return dataclasses.replace(info, has_targets=False), None  # per-position targets: no per-sequence MSE
    return info, None


def _affine_source(fn: Model | Heads, data: str | os.PathLike, affine_from: str | os.PathLike | None
                   ) -> tuple[WideSource, np.ndarray] | None:
    """(the wide tokens' source, the affine map (d_out, D + 1)) of a function with the affine map of the wide tokens,
    or None; a file given to a function without one, or none to one with it, is refused."""
    affine = affine_of(fn)
    if affine is not None or affine_from is not None:
        _check_not_reduced(fn, inspect_tokens(data).d, data)
    if affine is None:
        if affine_from is not None:
            raise Refused("{affine_from} was given but the function has no affine map of the wide tokens", data,
                          affine_from={})
        return None
    D = affine.shape[1] - 1
    if affine_from is not None:
        wide = WideSource.open(affine_from, data)
    else:
        info = inspect_tokens(data)
        if info.d != D:
            raise Refused(f"the function adds an affine map of the wide tokens (width {D}): give the tokens file "
                          "that mhla reduce read to make this one ({affine_file:WIDE.h5})", data, affine_file={})
        wide = WideSource(dataclasses.replace(info, has_targets=False, has_weights=False, samples=LAST, d_out=None), {})
    if wide.width != D:
        raise InputError(f"the wide tokens are {wide.width} wide but the function's affine map takes {D}", affine_from)
    return wide, affine



def _check_not_reduced(fn: Model | Heads, d: int, data: str | os.PathLike) -> None:
    """Refuse heads put back into the wide coordinates (`export-heads --unreduce`) on the reduced tokens (d = their
    reduced width): name the wide tokens file to give instead (the one `mhla reduce` read, when `data` records it)."""
    if not isinstance(fn, Heads) or fn.P is None or fn.P.shape[0] == d or fn.P.shape[1] != d:
        return
    made_from = [i.get("name") for i in formats.recorded_inputs(data) if i.get("name")]
    wide = f"{made_from[0]}, the file mhla reduce read to make this one" if made_from else "the file mhla reduce read"
    raise Refused(f"these heads were put back into the {fn.P.shape[0]}-wide coordinates ({{unreduced_heads}}) "
                  f"but the tokens are the {d}-wide reduced ones: predict the {fn.P.shape[0]}-wide tokens file "
                  f"({wide}), with no {{affine_from}}", data, unreduced_heads={}, affine_from={})


def predict_range(coef: np.ndarray | HeadsFn, info: Any, layout: Samples | None, sample_range: tuple[int, int],
                 normalize: str = "none", device: str | None = None, basis: np.ndarray | None = None,
                 affine: tuple[WideSource, np.ndarray] | None = None
                 ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, int, Spread]:
    """Predictions for samples [lo, hi): (pred (B, d), outputs (t, d) or None, offsets, count, the
    targets' Spread (their weight, spread and weighted SSE: the MSE and R^2)).

    With last-token targets the SSE is sum_i w_i ||pred_i - y_i||^2, count #{i: w_i > 0} and weight
    sum_i w_i (w_i = 1 without `weights`), as in `causal_range`; without targets (info.has_targets
    false) all are 0. `basis`: the tokens X basis are evaluated (Model.evaluation).
    """
    lo, hi = sample_range
    for a, _b, tokens, offsets, targets, *w in iter_chunks(info, (lo, hi), hi - lo, prefetch=False,
                                                            with_weights=info.has_targets):
        weights = w[0] if w else None
        check_finite(tokens, offsets, targets, a, info.path)
        check_weights(weights, offsets, a, info.per_position, info.path)
        pred, outputs = predict_chunk(coef, in_basis(tokens, basis), offsets, layout, normalize,
                                      device=worker_device(device))
        if affine is not None:  # the affine map of the wide tokens at the last token (and every position)
            aff = _affine_range(affine, a, offsets)
            pred = pred + aff[offsets[1:] - 1]
            outputs = None if outputs is None else outputs + aff
        count, spread = scored(pred, targets, weights) if targets is not None else (0, Spread())
        return pred, outputs, offsets.copy(), count, spread
    raise ValueError("empty sample range")


def _predict_sum_file(fn: HeadsSum, data: str | os.PathLike, out: str | os.PathLike | None, chunk_size: int | None,
                      progress: Callable[[int], None] | None, inputs: tuple[str | os.PathLike, ...], workers: int,
                      map: Callable[..., Any] | None) -> Predictions:  # noqa: A002
    """`predict_file` of a sum of blocks: `predictions` (N, D_out) at the last tokens and, for a per-position
    layout, `outputs` (T, D_out) at every sample of it (scored against per-position targets), written by the same
    writer as a model's."""
    info = inspect_tokens(data)
    if info.d != fn.d:
        raise InputError(f"the data have d = {info.d} but the blocks take {fn.d}-dim tokens", data)
    if info.has_targets and info.out_dim != fn.d_out:
        raise InputError(f"the targets are {info.out_dim} wide but the blocks' outputs {fn.d_out}", data)
    samples = fn.layout if fn.layout.per_position else None
    info, scored_as = _scored_info(info, samples, fn.layout, samples)
    per_seq = 8 * max(1.0, info.n_tokens / max(1, info.n_samples)) * (fn.d + 2 * fn.d_out + max(
        h.reduced_dim for h in fn.parts) ** 2)
    todo = chunk_ranges(0, info.n_samples, chunk_size or int(max(1, min(info.n_samples, DIRECT_CHUNK_BYTES // per_seq))))

    def run(target: h5py.File | None) -> tuple[tuple[Any, Any, Any], tuple[int, Spread]]:
        sinks = _sinks(target, info, fn.d_out, samples is not None)
        with make_map(workers=workers, map=map) as pmap:
            winfo = info if pmap.n_workers == 1 else dataclasses.replace(info, path=os.path.abspath(info.path))
            return sinks, _predict_ranges(partial(sum_range, fn, winfo, samples), todo, pmap, sinks, progress)

    result = Predictions(info.n_samples, fn.d_out, fn.normalize)
    if out is not None:
        meta = {"d": fn.d_out, "n_samples": info.n_samples, "normalize": fn.normalize, CAUSAL.name: int(samples == CAUSAL),
                **(samples.fit_attrs() if samples is not None else {})}
        _, (count, spread) = _write_predictions(out, (data, *inputs), meta, run)
    else:
        (result.predictions, result.outputs, result.offsets), (count, spread) = run(None)
    if info.has_targets:
        result.scored_as, result.mse, result.r2, result.n_scored = scored_as or "sequences", spread.mse(
            fn.d_out), spread.r2(), count
    return result


def sum_range(fn: HeadsSum, info: TokensInfo, samples: Samples | None, sample_range: tuple[int, int]
              ) -> tuple[np.ndarray, np.ndarray | None, np.ndarray, int, Spread]:
    """`predict_range` of a sum of blocks (HeadsSum.predict): (pred (B, D_out), the outputs at every sample of
    `samples` or None, offsets, count, the scored targets' Spread)."""
    lo, hi = sample_range
    for a, _b, tokens, offsets, targets, weights in iter_chunks(info, (lo, hi), hi - lo, prefetch=False,
                                                                with_weights=True):
        check_finite(tokens, offsets, targets, a, info.path)
        check_weights(weights, offsets, a, info.per_position, info.path)
        X = np.asarray(tokens, dtype=np.float64)
        outputs = None if samples is None else fn.predict(X, offsets, layout=samples)
        pred = fn.predict(X, offsets, layout=LAST) if outputs is None else outputs[offsets[1:] - 1]
        count, spread = (0, Spread()) if targets is None else scored(
            outputs if info.per_position and outputs is not None else pred, targets, weights)
        return pred, outputs, offsets.copy(), count, spread
    raise ValueError("empty sample range")
