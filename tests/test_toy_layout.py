"""A sample layout defined OUTSIDE the package (mhla_cli.samples: "a new layout is one subclass, registered"): a
sliding window of width w, the query at t attending to X[t-w+1..t]. featurize, certify, fit, predict (library and
CLI) and `Heads.to_torch` run through it with no edit inside mhla_cli, against plain numpy on materialised
features (tests/_reference.py); the layout rides in the files with its width and pickles by value. And the
layout names appear in no library module but samples.py (a grep of the string literals)."""

from __future__ import annotations

import ast
import json
import pickle
from dataclasses import dataclass
from pathlib import Path

import _reference as ref
import h5py
import numpy as np
import pytest
from conftest import relerr

from mhla_cli import fit as learn_fit
from mhla_cli.cli import run
from mhla_cli.errors import InputError
from mhla_cli.model import synthetic
from mhla_cli.model.forward import forward_heads, predict_file, predict_samples
from mhla_cli.model.model import Model
from mhla_cli.samples import (
    LAYOUTS,
    SpanSamples,
    attentions,
    from_attrs,
    named,
    register,
)
from mhla_cli import certify
from mhla_cli.statistics.stream import featurize

PACKAGE = Path(__file__).resolve().parent.parent / "mhla_cli"


@register
@dataclass(frozen=True)
class SlidingWindow(SpanSamples):
    """The query at t reads S of the last `width` tokens up to t (fewer at a window's start)."""

    width: int = 2
    name = "toy_window"
    predicts_every_position = True  # predict writes and scores its outputs at every position
    words = "sliding windows (one sample per position t, S of the tokens t-w+1..t)"
    scored_words = "every sliding window"

    def __post_init__(self) -> None:
        if not (isinstance(self.width, int) and self.width >= 1):
            raise ValueError(f"width must be an integer >= 1, got {self.width!r}")

    def spans(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        t = np.arange(n, dtype=np.int64)
        return np.maximum(0, t - self.width + 1), t + 1


W = 3
TOY = named("toy_window", width=W)


def _data(seed: int, d: int = 3, n_seq: int = 14) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 9, size=n_seq)
    off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    return rng.standard_normal((int(off[-1]), d)), off


def _teacher_outputs(V: np.ndarray, Q: np.ndarray, X: np.ndarray, off: np.ndarray, normalize: str) -> np.ndarray:
    """sum_h V_h S_t Q_h x_t with S_t of the window's tokens X[t-W+1..t], written out per position."""
    out = []
    for Xs, _, _ in ref.samples(X, off, True, width=W):
        S = Xs.T @ Xs / (Xs.shape[0] if normalize == "length" else 1.0)
        out.append(sum(V[h] @ S @ Q[h] @ Xs[-1] for h in range(V.shape[0])))
    return np.array(out)


def _write(path: Path, **data: np.ndarray) -> Path:
    """A tokens file whose attributes name the toy layout and its width (as `Samples.attrs` writes them)."""
    with h5py.File(path, "w") as f:
        for k, v in data.items():
            f[k] = v
        for k, v in TOY.attrs().items():
            if k != "per_position":
                f.attrs[k] = v
    return path


def test_the_toy_layout_by_value_in_files_and_across_processes() -> None:
    assert TOY == SlidingWindow(W) and TOY != SlidingWindow(W + 1) and hash(TOY) == hash(SlidingWindow(W))
    assert pickle.loads(pickle.dumps(TOY)) is TOY and pickle.loads(pickle.dumps(SlidingWindow(5))) == named(
        "toy_window", width=5)
    assert TOY.attrs() == {"per_position": 1, "attention": "toy_window", "attention_width": W}
    assert from_attrs(TOY.attrs()) is TOY and "toy_window" in attentions() and "toy_window" not in LAYOUTS
    with pytest.raises(InputError, match="attention_width"):
        from_attrs({"per_position": 1, "attention": "toy_window"})
    with pytest.raises(InputError, match="invalid"):
        from_attrs({"per_position": 1, "attention": "toy_window", "attention_width": 0})
    with pytest.raises(ValueError, match="registered already"):
        register(type("Other", (SlidingWindow,), {"name": "toy_window", "__annotations__": {}}))


@pytest.mark.parametrize("normalize", ["none", "length"])
def test_featurize_certify_fit_predict_through_a_toy_layout(tmp_path: Path, normalize: str,
                                                           capsys: pytest.CaptureFixture[str]) -> None:
    rng = np.random.default_rng(3)
    d = 3
    X, off = _data(4, d)
    teacher = synthetic.random_teacher(d, 2, rng)
    Y = _teacher_outputs(teacher.V, teacher.Q, X, off, normalize)
    w = rng.uniform(0.2, 2.0, X.shape[0])
    w[rng.random(X.shape[0]) < 0.2] = 0.0
    path = _write(tmp_path / "t.h5", tokens=X, offsets=off, targets=Y, weights=w)
    # featurize: the statistics of the materialised features of every window
    G = M = 0.0
    for Xs, wt, t in ref.samples(X, off, True, w, width=W):
        h = ref.features(Xs, normalize)
        G, M = G + wt * np.outer(h, h), M + wt * np.outer(h, Y[t])
    for chunk in (5, None):
        f = featurize(path, chunk_size=chunk, normalize=normalize)
        assert f.samples is TOY and f.n_samples == int((w > 0).sum())
        assert relerr(f.gram, G) < 1e-10 and relerr(f.moments, M) < 1e-10
    # certify: the spectrum of the materialised Lambda~
    r = ref.canonical(X, off, Y, True, w, normalize, width=W)
    ev, cert = r["eigenvalues"], certify(f)
    assert cert.identifiable == (ev[0] > 1e-9 * ev[-1]) and abs(cert.lambda_max - ev[-1]) <= 1e-9 * ev[-1]
    # fit: the teacher; the model records the layout with its width
    model = learn_fit(f)
    assert relerr(model.coef, ref.teacher_p(teacher)) < 1e-8
    assert model.info["attention"] == "toy_window" and model.info["attention_width"] == W
    # predict (library): the outputs at every window, scored
    res = predict_file(model, path)
    assert res.scored_as == "toy_window" and res.mse < 1e-20 and relerr(res.outputs, Y) < 1e-9
    assert relerr(predict_samples(model, X, off), Y) < 1e-9
    full = np.concatenate([forward_heads(teacher.V, teacher.Q, X[a:b], normalize=normalize, layout=TOY)
                           for a, b in zip(off[:-1], off[1:])])
    assert relerr(full, Y) < 1e-12
    # the CLI: fit (the file's layout, or asked by name) and predict, through the files
    mpath, out = tmp_path / "m.h5", tmp_path / "p.h5"
    assert run(["fit", str(path), "-o", str(mpath), "-q", "--normalize", normalize, "--attention", "toy_window"]) == 0
    assert Model.load(mpath).info["attention_width"] == W
    capsys.readouterr()
    assert run(["predict", str(mpath), str(path), "-o", str(out), "--json", "--chunk-size", "4"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["scored_as"] == "toy_window" and got["mse"] < 1e-20 and got["n_scored"] == int((w > 0).sum())
    with h5py.File(out) as fo:
        assert relerr(fo["outputs"][()], Y) < 1e-9 and fo.attrs["attention_width"] == W


def test_to_torch_through_a_toy_layout() -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(6)
    teacher = synthetic.random_teacher(3, 2, rng)
    X, off = _data(7, 3, 6)
    Y = _teacher_outputs(teacher.V, teacher.Q, X, off, "length")
    teacher.info["normalize"] = "length"
    m = teacher.to_torch()
    got = np.concatenate([m(torch.from_numpy(X[a:b]), layout=TOY).detach().numpy()
                          for a, b in zip(off[:-1], off[1:])])
    assert relerr(got, Y) < 1e-12


# ------------------------------------------------------------------------------------------------ the grep


def _layout_literals(path: Path) -> list[str]:
    """The string literals of a module that equal a built-in layout's name (`Samples.name`), with their line:
    a name may appear inside text (docstrings, help, messages), never as a value of its own."""
    names = set(LAYOUTS)
    return [f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: {node.value!r}"
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in names]


def test_layout_names_live_in_samples_py_only() -> None:
    """No string literal equal to a layout's name outside mhla_cli/samples.py: the CLI's choices, the files'
    attributes, the forward pass and the words all ask the layout objects."""
    found = [hit for p in sorted(PACKAGE.rglob("*.py")) if p.name != "samples.py" or p.parent != PACKAGE
             for hit in _layout_literals(p)]
    assert not found, "layout names outside samples.py:\n" + "\n".join(found)
    assert _layout_literals(PACKAGE / "samples.py")  # the rule sees them where they live


@pytest.mark.parametrize("suffix", [".h5", ".npz", ".safetensors"])
def test_heads_of_a_toy_layout_keep_its_width_in_every_heads_format(tmp_path: Path, suffix: str) -> None:
    """Exported heads carry the layout and its parameters (not only its name) in every format, and predict through
    them reads every sliding window again."""
    if suffix == ".safetensors":
        pytest.importorskip("safetensors")
    from mhla_cli import export_heads
    from mhla_cli.model.export import load_heads, save_heads

    rng = np.random.default_rng(8)
    X, off = _data(9, 3, 12)
    teacher = synthetic.random_teacher(3, 2, rng)
    Y = _teacher_outputs(teacher.V, teacher.Q, X, off, "none")
    path = _write(tmp_path / "t.h5", tokens=X, offsets=off, targets=Y)
    heads = export_heads(learn_fit(featurize(path)))
    save_heads(heads, tmp_path / f"h{suffix}")
    back = load_heads(tmp_path / f"h{suffix}")
    assert back.info["attention"] == "toy_window" and back.info["attention_width"] == W
    res = predict_file(back, path)
    assert res.scored_as == "toy_window" and relerr(res.outputs, Y) < 1e-8
