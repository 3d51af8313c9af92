"""Data drawn for the metamorphic tests (hypothesis strategies) and their shared checks: test_metamorphic.py
(last-token and causal data) and test_bidirectional.py (every position of the whole window)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
from hypothesis import strategies as st

from _reference import canonical
from mhla_cli.model import synthetic
from mhla_cli.statistics.stream import chunk_features


@dataclass
class Data:
    tokens: np.ndarray
    offsets: np.ndarray
    targets: np.ndarray
    weights: np.ndarray | None
    per_position: bool
    normalize: str
    d: int
    attention: str = "causal"  # how per-position samples read the window (mhla_cli.samples)

    def kw(self) -> dict:
        return {"weights": self.weights, "per_position": self.per_position, "normalize": self.normalize,
                "attention": self.attention if self.per_position else None}

    def reference(self) -> dict:
        """The materialised canonical statistics of the data (tests/_reference.py)."""
        return canonical(self.tokens, self.offsets, self.targets, self.per_position, self.weights, self.normalize,
                         attention=self.attention)

    def feats(self, tokens: np.ndarray | None = None):
        X = self.tokens if tokens is None else tokens
        return chunk_features(X, self.offsets, self.targets, self.d, **self.kw())

    def write(self, path: Path, tokens: np.ndarray | None = None, order: np.ndarray | None = None) -> Path:
        """A tokens file (sequences in `order`), as a user would write it with h5py."""
        X = self.tokens if tokens is None else tokens
        off = self.offsets
        seqs = [X[a:b] for a, b in zip(off[:-1], off[1:])]
        order = np.arange(len(seqs)) if order is None else order
        new_off = np.concatenate([[0], np.cumsum([len(seqs[i]) for i in order])])
        rows = np.concatenate([np.arange(off[i], off[i + 1]) for i in order])
        with h5py.File(path, "w") as f:
            f["tokens"] = np.concatenate([seqs[i] for i in order])
            f["offsets"] = new_off
            f["targets"] = self.targets[rows] if self.per_position else self.targets[order]
            if self.weights is not None:
                f["weights"] = self.weights[rows] if self.per_position else self.weights[order]
            if self.normalize != "none":
                pass  # the normalisation is an option of featurize, not of the file
            if self.per_position and self.attention != "causal":
                f.attrs["attention"] = self.attention  # as `mhla convert --attention` records it
        return path


@st.composite
def datasets(draw, min_n: int = 40, max_n: int = 70, dims: tuple[int, ...] = (2, 3), attention: str = "causal"
             ) -> Data:
    """Data of a random teacher; `attention` "bidirectional": per-position targets at every position with the
    whole window's S (otherwise last-token or causal per-position data, drawn)."""
    d = draw(st.sampled_from(list(dims)))
    n_seq = draw(st.integers(min_n, max_n))
    dense = draw(st.booleans())
    per_position = True if attention == "bidirectional" else draw(st.booleans())
    weighted = draw(st.booleans())
    normalize = draw(st.sampled_from(["none", "length"]))
    dtype = draw(st.sampled_from(["float32", "float64"]))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    lengths = np.full(n_seq, 4) if dense else rng.integers(1, 7, size=n_seq)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = rng.standard_normal((int(offsets[-1]), d)).astype(dtype)
    teacher = synthetic.random_teacher(d, 2, rng)
    teacher.info["normalize"] = normalize
    from mhla_cli.model.forward import predict, predict_causal, predict_samples
    from mhla_cli.samples import BIDIRECTIONAL

    X64 = tokens.astype(np.float64)
    if attention == "bidirectional":
        y = predict_samples(teacher, X64, offsets, BIDIRECTIONAL)
    else:
        y = np.asarray(predict_causal(teacher, X64, offsets) if per_position else predict(teacher, X64, offsets))
    rows = int(offsets[-1]) if per_position else n_seq
    weights = None
    if weighted:
        weights = rng.uniform(0.5, 2.0, size=rows)
        weights[rng.random(rows) < 0.1] = 0.0
    return Data(tokens, offsets, y, weights, per_position, normalize, d, attention)


def transform(d: int, cond: float, seed: int) -> np.ndarray:
    """A rotated (not axis-aligned) invertible map with condition number `cond`."""
    rng = np.random.default_rng(seed)
    U = np.linalg.qr(rng.standard_normal((d, d)))[0]
    V = np.linalg.qr(rng.standard_normal((d, d)))[0]
    return U @ np.diag(np.logspace(0, np.log10(cond), d)) @ V.T


def probes(d: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((n, d)) for n in (1, 2, 3, 5, 8, 13)]


def predict_model(model, Zs: list[np.ndarray]) -> np.ndarray:
    """mhla's predict of a fitted model on each input Z (its normalisation)."""
    from mhla_cli.model.forward import predict

    return np.stack([predict(model, Z[None])[0] for Z in Zs])


def same_certificate(a, b, rel: float = 1e-6) -> None:
    assert a.identifiable == b.identifiable and a.rank == b.rank
    scale = max(abs(b.lambda_max), 1e-300)
    assert abs(a.lambda_max - b.lambda_max) <= rel * scale
    # lambda_min to `rel` of itself when the data certify, else to `rel` of lambda_max
    assert abs(a.lambda_min - b.lambda_min) <= rel * (abs(b.lambda_min) if b.identifiable else scale)
