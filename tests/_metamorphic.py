"""Data drawn for the metamorphic tests (hypothesis strategies) and their shared checks: test_metamorphic.py
(last-token and causal data) and test_bidirectional.py (every position of the whole window)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st

from _reference import canonical
from mhla_cli.model import synthetic
from mhla_cli.statistics.accumulate import chunk_features
from mhla_cli.samples import ReadSpec, samples_of

SETTINGS = settings(max_examples=30, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
FILE_SETTINGS = settings(max_examples=8, deadline=None, derandomize=True,
                         suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


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
        return {"weights": self.weights, "read": ReadSpec(samples_of(self.per_position, self.attention if
                                                                     self.per_position else None), self.normalize)}

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


def file_variants(data: Data, path: Path, tmp: Path, chunk: int, pseed: int) -> dict:
    """The statistics of the tokens file `path` (written by `data.write`) after what cannot change the answer:
    another order of the sequences, another chunk size, two workers, every sequence duplicated, and three
    shards merged."""
    from mhla_cli.statistics.merge import merge_features
    from mhla_cli.statistics.stream import featurize

    N = data.offsets.size - 1
    variants = {
        "order": featurize(data.write(tmp / "p.h5", order=np.random.default_rng(pseed).permutation(N)),
                           normalize=data.normalize),
        "chunk": featurize(path, chunk_size=chunk, normalize=data.normalize),
        "workers": featurize(path, chunk_size=chunk, workers=2, normalize=data.normalize),
        "duplicated": featurize(data.write(tmp / "dup.h5", order=np.repeat(np.arange(N), 2)),
                                normalize=data.normalize),
    }
    parts = []
    for i in range(3):
        parts.append(tmp / f"s{i}.h5")
        featurize(path, shard=(i, 3), chunk_size=chunk, normalize=data.normalize).save(parts[-1])
    variants["shards"] = merge_features(parts).features
    return variants


def check_partial_fit(data: Data, cuts: list[int], scale: float = 1.0) -> None:
    """MHLA.partial_fit over the chunks cut at `cuts` equals one fit of all the data (certificate and function);
    `scale` != 1 squashes the first chunk along a rotated direction."""
    from _reference import predict_own, ratio
    from mhla_cli import MHLA

    N = data.offsets.size - 1
    tokens = data.tokens.astype(np.float64).copy()
    first = sorted(cuts)[0]
    if scale != 1.0:  # the first chunk squashed along a rotated direction
        R = transform(data.d, 1.0, 5)
        a = data.offsets[first]
        Z = tokens[:a] @ R
        Z[:, -1] *= scale
        tokens[:a] = Z @ R.T
    ts = np.asarray(data.targets)
    kw = {"per_position": data.per_position, "normalize": data.normalize, "attention": data.attention}
    one = MHLA(**kw).fit([tokens[a:b] for a, b in zip(data.offsets[:-1], data.offsets[1:])],
                         _split(ts, data.offsets, data.per_position, 0, N),
                         sample_weight=None if data.weights is None else data.weights)
    est = MHLA(**kw)
    bounds = [0, *sorted(c for c in cuts if c < N), N]
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        if hi <= lo:
            continue
        seqs = [tokens[data.offsets[i]:data.offsets[i + 1]] for i in range(lo, hi)]
        w = None
        if data.weights is not None:
            w = data.weights[data.offsets[lo]:data.offsets[hi]] if data.per_position else data.weights[lo:hi]
            if not (w > 0).any() and est.__dict__.get("coef_") is None:
                return  # a first chunk without samples is refused (and nothing is fitted)
        try:
            est.partial_fit(seqs, _split(ts, data.offsets, data.per_position, lo, hi), sample_weight=w)
        except Exception as e:  # only a chunk whose weights are all 0 may be refused
            assert "no sample" in str(e)
            return
    same_certificate(est.certificate_, one.certificate_, rel=1e-8)
    Zs = probes(data.d, 3)
    assert ratio(predict_own(est.coef_, Zs, data.normalize), predict_own(one.coef_, Zs, data.normalize)) < 1e-7


def _split(y: np.ndarray, offsets: np.ndarray, per_position: bool, lo: int, hi: int):
    if per_position:
        return [y[offsets[i]:offsets[i + 1]] for i in range(lo, hi)]
    return y[lo:hi]
