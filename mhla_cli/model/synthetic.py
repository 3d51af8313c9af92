"""Synthetic datasets: random MHLA teachers with Gaussian tokens, and the associative memory."""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ..io import formats
from ..errors import InputError
from .heads import Heads
from .forward import predict, predict_samples
from ..samples import LAST, ReadSpec, Samples, samples_of


@dataclass
class Dataset:
    """In-memory tokens in the ragged layout: tokens (T, d), offsets (N+1,), targets (N, d).

    Per-position data have targets (T, d) (one per position); optional weights (N,) or (T,);
    `attention` ("causal" / "bidirectional") says how per-position targets read the window (the
    tokens file's attribute, mhla_cli.samples).
    """

    tokens: np.ndarray
    offsets: np.ndarray
    targets: np.ndarray
    weights: np.ndarray | None = None
    attention: str | None = None

    @property
    def per_position(self) -> bool:
        return bool(self.targets.shape[0] == self.tokens.shape[0] and self.tokens.shape[0] != self.n_samples)

    @property
    def n_samples(self) -> int:
        return int(self.offsets.size - 1)

    def sequence(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i]:self.offsets[i + 1]]

    def save(self, path: str | os.PathLike, dtype: str = "float32", compression: str | None = "gzip",
             attrs: dict | None = None) -> None:
        """Write a tokens file; equal lengths use the (N, n, d) layout, ragged ones (T, d) + offsets.

        Tokens are stored as `dtype`; targets always as float64 (they are small, and exact targets
        keep realisable data exactly realisable).
        """
        lengths = np.diff(self.offsets)
        d = self.tokens.shape[1]
        tok = self.tokens.astype(dtype)
        data: dict[str, np.ndarray] = {"targets": self.targets.astype(np.float64)}
        if self.weights is not None:
            data["weights"] = np.asarray(self.weights, dtype=np.float64)
        if (lengths == lengths[0]).all():
            data["tokens"] = tok.reshape(self.n_samples, int(lengths[0]), d)
            if self.per_position:
                data["targets"] = data["targets"].reshape(self.n_samples, int(lengths[0]), d)
        else:
            data["tokens"] = tok
            data["offsets"] = self.offsets.astype(np.int64)
        if self.attention is not None:
            attrs = {**(attrs or {}), "attention": self.attention}
        formats.write_file(path, "tokens", data, attrs, compression=compression)


def parse_seq_len(spec: str | int) -> tuple[int, int]:
    """'n' or 'MIN:MAX' -> (min, max), both >= 1."""
    try:
        if isinstance(spec, int):
            lo = hi = spec
        elif ":" in spec:
            a, b = spec.split(":", 1)
            lo, hi = int(a), int(b)
        else:
            lo = hi = int(spec)
    except ValueError:
        raise InputError(f"sequence length '{spec}': expected an integer n or MIN:MAX") from None
    if lo < 1 or hi < lo:
        raise InputError(f"sequence length '{spec}': need 1 <= MIN <= MAX")
    return lo, hi


def random_teacher(d: int, n_heads: int, rng: np.random.Generator, bias: bool = False) -> Heads:
    """A random H-head MHLA with Gaussian V_h, Q_h of entry variance 1/d (rescaled by the caller); with `bias`
    also its bias terms (mhla_cli.bias_terms), standard Gaussian (drawn after V and Q: the same V, Q as
    without them for a seed)."""
    V = rng.standard_normal((n_heads, d, d)) / np.sqrt(d)
    Q = rng.standard_normal((n_heads, d, d)) / np.sqrt(d)
    if not bias:
        return Heads(V=V, Q=Q)
    return Heads(V=V, Q=Q, value_bias=rng.standard_normal((n_heads, d)), score_key=rng.standard_normal((n_heads, d)),
                 score_query=rng.standard_normal((n_heads, d)), score_bias=rng.standard_normal(n_heads))


def generate_teacher(d: int, n_heads: int, n_samples: int, seq_len: str | int | tuple[int, int] = 100,
                     noise: float = 0.0, seed: int = 0, dtype: str = "float64", read: ReadSpec | None = None
                     ) -> tuple[Dataset, Heads]:
    """Gaussian tokens N(0, I), targets from a random H-head teacher scaled so outputs have RMS 1.

    Tokens are rounded to `dtype` before the targets are computed, so that data stored in that
    dtype are exactly realisable. `read` (mhla_cli.samples.ReadSpec; None: last-token samples, S not
    normalised, no bias terms): with a per-position layout, targets (T, d), the teacher's output at every
    position: of every prefix ("causal": an autoregressive teacher), or with the whole sequence's S
    ("bidirectional": an encoder's teacher); the dataset records the attention. `read.normalize` "length":
    the teacher divides S by the number of tokens (recorded in the teacher's heads). `read.bias_terms`: a
    teacher with bias terms (docs/bias_terms.md): head h outputs sum_i (V_h x_i + value_bias_h)
    (x_i^T Q_h x_t + score_key_h . x_i + score_query_h . x_t + score_bias_h), which `--bias-terms` fits exactly.
    """
    read = ReadSpec(LAST) if read is None else read
    layout, normalize, bias = read.layout, read.normalize or "none", read.bias_terms
    samples = layout if isinstance(layout, Samples) else samples_of(layout is not None, layout)
    per_position = samples.per_position
    if d < 1 or n_heads < 1 or n_samples < 1:
        raise InputError("dim, heads and n_samples must be >= 1")
    if noise < 0:
        raise InputError("noise must be >= 0")
    lo, hi = seq_len if isinstance(seq_len, tuple) else parse_seq_len(seq_len)
    rng = np.random.default_rng(seed)
    teacher = random_teacher(d, n_heads, rng, bias)
    lengths = rng.integers(lo, hi + 1, size=n_samples)
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = rng.standard_normal((int(offsets[-1]), d)).astype(dtype).astype(np.float64)
    teacher.info["normalize"] = normalize
    if per_position:
        y = predict_samples(teacher, tokens, offsets, samples)
    else:
        y = np.asarray(predict(teacher, tokens, offsets))
    rms = float(np.sqrt(np.mean(y**2)))
    if rms > 0:
        # Scale V and Q by rms^-1/2 each: the output is bilinear in (V, Q).
        c = 1.0 / np.sqrt(rms)
        teacher = Heads(V=teacher.V * c, Q=teacher.Q * c, info={"normalize": normalize},
                        **{k: v * c for k, v in teacher.bias_arrays().items()})  # both sides of the bilinear form
        y = y / rms
    if samples.attention is not None:  # the teacher's outputs are per position, read so
        teacher.info.update(samples.fit_attrs())
    if noise > 0:
        y = y + noise * rng.standard_normal(y.shape)
    return Dataset(tokens, offsets, y, attention=samples.attention), teacher


def assoc_teacher(keys: int) -> Heads:
    """The exact 1-head teacher of the associative memory: V = [[0,0],[0,I]], Q = [[I,0],[0,0]]."""
    k = keys
    V = np.zeros((1, 2 * k, 2 * k))
    Q = np.zeros((1, 2 * k, 2 * k))
    V[0, k:, k:] = np.eye(k)
    Q[0, :k, :k] = np.eye(k)
    return Heads(V=V, Q=Q)


def _random_orthogonal(rng: np.random.Generator, k: int, m: int) -> np.ndarray:
    """m random k x k orthogonal matrices (Haar, via QR with sign correction)."""
    A = rng.standard_normal((m, k, k))
    Qm, R = np.linalg.qr(A)
    out: np.ndarray = Qm * np.sign(np.diagonal(R, axis1=1, axis2=2))[:, None, :]
    return out


def generate_assoc(keys: int, n_samples: int, orthogonal_fraction: float = 0.0, seed: int = 0,
                   dtype: str = "float64") -> tuple[Dataset, Heads]:
    """The paper's associative memory: rows (k_j, v_j), j = 1..k, then (q, 0); target (0, sum_j <q,k_j> v_j).

    A fraction of samples take keys and values from rows of fresh random orthogonal matrices; the rest
    draw them from N(0, I/k) (rows of unit expected norm). Queries are N(0, I/k).
    """
    if keys < 1 or n_samples < 1:
        raise InputError("keys and n_samples must be >= 1")
    if not 0.0 <= orthogonal_fraction <= 1.0:
        raise InputError("orthogonal_fraction must be in [0, 1]")
    k = keys
    rng = np.random.default_rng(seed)
    n_orth = int(round(orthogonal_fraction * n_samples))
    K = rng.standard_normal((n_samples, k, k)) / np.sqrt(k)
    Vv = rng.standard_normal((n_samples, k, k)) / np.sqrt(k)
    if n_orth:
        K[:n_orth] = _random_orthogonal(rng, k, n_orth)
        Vv[:n_orth] = _random_orthogonal(rng, k, n_orth)
    perm = rng.permutation(n_samples)
    K, Vv = K[perm], Vv[perm]
    q = rng.standard_normal((n_samples, k)) / np.sqrt(k)
    # Round to the storage dtype first so that the stored data are exactly realisable.
    K, Vv, q = (a.astype(dtype).astype(np.float64) for a in (K, Vv, q))
    X = np.zeros((n_samples, k + 1, 2 * k))
    X[:, :k, :k] = K
    X[:, :k, k:] = Vv
    X[:, k, :k] = q
    y = np.zeros((n_samples, 2 * k))
    y[:, k:] = np.einsum("bc,bjc,bjv->bv", q, K, Vv)
    offsets = np.arange(n_samples + 1, dtype=np.int64) * (k + 1)
    return Dataset(X.reshape(-1, 2 * k), offsets, y), assoc_teacher(k)
