"""Token directions that keep what a head reads: the maps P of `mhla reduce --method supervised|weights`.

Both methods work in the tokens' own whitened metric. With C the tokens' mean second moment (D x D) and
C = E diag(lam) E^T restricted to its range (eigenvalues above WHITEN_RTOL times the largest), the whitened
tokens t = diag(lam)^(-1/2) E^T x (r wide) have identity second moment, and a linear read of the token is
M^T t for an (r, m) matrix M. The rank-d projection of t that keeps the read best in mean square keeps the
top-d left singular vectors U_d of M (`top_reads`, Eckart-Young), i.e. the readings
P = E diag(lam)^(-1/2) U_d (D x d, P^T C P = I: the reduced tokens z = P^T x have unit mean square):

- supervised: the token-wise least-squares map B = C^-1 C_xy from the tokens to the targets; its prediction
  B^T x = M^T t with M = diag(lam)^(-1/2) E^T C_xy (= C^(1/2) B): reduced-rank regression;
- weights: a head reads the token only through W x (W: W_Q, W_K, W_V stacked, k x D); W x = M^T t with
  M = diag(lam)^(1/2) E^T W^T (= (W C^(1/2))^T).

Both are unit-free: an invertible map of the wide tokens (x -> A^T x, and W -> W A^-T) changes t by an orthogonal
map, and so z only by an invertible d x d map. When the read has fewer than d directions (singular values at or
below RANK_RTOL times the largest count as none) the rest are completed by the tokens' principal directions in the
whitened complement of those kept: the top eigenvectors of (I - U U^T) diag(lam) (I - U U^T), i.e. the top
principal directions of the tokens once the kept readings' linear prediction of them is removed (this completion,
like PCA, is unit-free only under orthogonal maps). The share kept is sum_{i <= d} s_i^2 / sum s_i^2 of the
singular values of M: the share of the read's mean square (1.0 for a read of zero).
"""

from __future__ import annotations

import os
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import InputError, Refused
from ..io.convert import READERS

__all__ = ["RANK_RTOL", "WEIGHT_KEYS", "WHITEN_RTOL", "Whitening", "load_read_weights", "sign_columns", "supervised",
           "top_reads", "weight_directions", "whitening"]

# Eigenvalues of the tokens' second moment at or below WHITEN_RTOL times the largest span the tokens' null space
# (directions the tokens do not take: left out of the whitened metric). Far above eigh's rounding (~D eps) and
# float32 tokens' rounding (~1e-15), far below any direction a head could read.
WHITEN_RTOL = 1e-10
# Singular values of the whitened read M at or below RANK_RTOL times the largest are zero (the read's rank):
# the directions past them are completed by the tokens' principal directions.
RANK_RTOL = 1e-8
# The names of the arrays a --weights file may hold: each (k, D) (rows read the token: W x, as torch's
# nn.Linear.weight) or stacked (m, k, D); every array of the file is read, stacked row by row.
WEIGHT_KEYS = ("W", "W_Q", "W_K", "W_V")
# The file suffixes of a --weights file, and the readers (mhla_cli.io.convert) that read them.
WEIGHT_SUFFIXES = (".npz", ".safetensors")


@dataclass(frozen=True)
class Whitening:
    """The range of a second moment C: eigenvectors E (D, r) and eigenvalues lam (r,), descending."""

    E: np.ndarray
    lam: np.ndarray

    @property
    def rank(self) -> int:
        return int(self.lam.size)

    def readings(self, U: np.ndarray) -> np.ndarray:
        """P = E diag(lam)^(-1/2) U (D, k): the readings of the tokens whose whitened directions are U (r, k)."""
        return self.E @ (U / np.sqrt(self.lam)[:, None])


def whitening(C: np.ndarray) -> Whitening:
    """The range of a symmetric positive semi-definite C (eigenvalues above WHITEN_RTOL times the largest)."""
    C = np.asarray(C, dtype=np.float64)
    w, V = np.linalg.eigh(0.5 * (C + C.T))
    w, V = w[::-1], V[:, ::-1]
    top = float(w[0]) if w.size else 0.0
    keep = w > WHITEN_RTOL * top if top > 0 else np.zeros(w.size, dtype=bool)
    return Whitening(np.ascontiguousarray(V[:, keep]), np.ascontiguousarray(w[keep]))


def sign_columns(P: np.ndarray) -> np.ndarray:
    """P with each column signed so that its largest-magnitude entry (the first of equal ones) is positive."""
    if P.shape[1] == 0:
        return P
    rows = np.argmax(np.abs(P), axis=0)
    return np.ascontiguousarray(P * np.where(P[rows, np.arange(P.shape[1])] < 0, -1.0, 1.0))


def top_reads(M: np.ndarray, d: int) -> tuple[np.ndarray, float]:
    """(U (r, k): the top left singular vectors of M (r, m), k <= d of them with singular values above RANK_RTOL
    times the largest; the share sum_{i <= d} s_i^2 / sum s_i^2 they keep, 1.0 when M = 0)."""
    U, s, _ = np.linalg.svd(np.asarray(M, dtype=np.float64), full_matrices=False)
    top = float(s[0]) if s.size else 0.0
    k = min(d, int(np.count_nonzero(s > RANK_RTOL * top))) if top > 0 else 0
    total = float(np.sum(s ** 2))
    share = 1.0 if total == 0 else float(np.sum(s[:k] ** 2) / total)
    return np.ascontiguousarray(U[:, :k]), share


def _complete(wh: Whitening, U: np.ndarray, d: int) -> np.ndarray:
    """U (r, k) completed to (r, d) by the top eigenvectors of (I - U U^T) diag(lam) (I - U U^T) (module docstring)."""
    k = U.shape[1]
    if k >= d:
        return U
    proj = np.eye(wh.rank) - U @ U.T
    G = proj @ (wh.lam[:, None] * proj)
    _, V = np.linalg.eigh(0.5 * (G + G.T))
    rest = V[:, ::-1][:, :d - k]
    rest -= U @ (U.T @ rest)  # exactly in the complement (the eigenvectors of eigenvalue 0 span U)
    rest = np.linalg.qr(rest)[0]
    return np.hstack([U, rest])


def _directions(wh: Whitening, M: np.ndarray, d: int, what: str, path: str | os.PathLike | None
                ) -> tuple[np.ndarray, float]:
    if d > wh.rank:
        raise Refused(f"{{dim:{d}}} is more than the {wh.rank} dimensions the tokens span ({what}: the eigenvalues "
                      f"of their second moment above {WHITEN_RTOL:g} times the largest): use {{dim_opt}} <= {wh.rank} "
                      "or {method:pca}", path, dim={}, dim_opt={}, method={})
    U, share = top_reads(M, d)
    return sign_columns(wh.readings(_complete(wh, U, d))), share


def supervised(Cxx: np.ndarray, Cxy: np.ndarray, d: int, path: str | os.PathLike | None = None
               ) -> tuple[np.ndarray, float]:
    """(P (D, d), share): the top-d input directions of the least-squares map from the tokens to the targets in the
    tokens' whitened metric (reduced-rank regression), of the mean second moments Cxx = E[w x x^T] (D, D) and
    Cxy = E[w x y^T] (D, D_out) over the scored samples; share: of the linear prediction's mean square."""
    wh = whitening(Cxx)
    M = wh.E.T @ np.asarray(Cxy, dtype=np.float64) / np.sqrt(wh.lam)[:, None]
    return _directions(wh, M, d, "at the scored samples", path)


def weight_directions(W: np.ndarray, C: np.ndarray, d: int, path: str | os.PathLike | None = None
                      ) -> tuple[np.ndarray, float]:
    """(P (D, d), share): the top-d directions that keep W x (W: k x D) in mean square over the tokens of mean second
    moment C (D, D): P = C^(-1/2) V_d, V_d the top right singular vectors of W C^(1/2); share: of E|W x|^2."""
    wh = whitening(C)
    M = (np.sqrt(wh.lam)[:, None] * wh.E.T) @ np.asarray(W, dtype=np.float64).T
    return _directions(wh, M, d, "every token", path)


def load_read_weights(path: str | os.PathLike, D: int) -> np.ndarray:
    """The matrices a head reads the token through, W (k, D) float64, from a .npz or .safetensors file whose arrays
    are all named in WEIGHT_KEYS, each (k, D) or stacked (m, k, D); stacked row by row in the order of WEIGHT_KEYS.
    Anything else is an InputError (one line)."""
    p = Path(path)
    suffix = p.suffix.lower()
    if suffix not in WEIGHT_SUFFIXES:
        raise Refused(f"{{weights}} takes a {' or '.join(WEIGHT_SUFFIXES)} file, not {suffix or 'no suffix'}", path,
                      weights={})
    if not p.is_file():
        raise InputError("no such file", path)
    reader = next(r for r in READERS if suffix in r.suffixes)
    with ExitStack() as stack:
        sources = {s.name: s for s in reader.sources(p, stack)}
        other = sorted(set(sources) - set(WEIGHT_KEYS))
        if other:
            raise Refused(f"{{weights}} holds {other[0]!r}; it takes only the arrays {', '.join(WEIGHT_KEYS)} "
                          f"(each (k, {D}) or stacked (m, k, {D}): the matrices the head reads the token through)",
                          path, weights={})
        if not sources:
            raise Refused(f"{{weights}} holds no array (expected {', '.join(WEIGHT_KEYS)})", path, weights={})
        parts = []
        for name in (k for k in WEIGHT_KEYS if k in sources):
            src = sources[name]
            if len(src.shape) not in (2, 3) or src.shape[-1] != D or 0 in src.shape:
                hint = " (a (D, k) array, e.g. TransformerLens's W_Q[layer, head], is the transpose: save W.T)" \
                    if len(src.shape) in (2, 3) and src.shape[-2] == D else ""
                raise Refused(f"{{weights}} array {name!r} has shape {tuple(src.shape)}, expected (k, {D}) or "
                              f"(m, k, {D}): rows that read the {D}-wide token{hint}", path, weights={})
            if src.dtype.kind not in "fiu":
                raise Refused(f"{{weights}} array {name!r} has dtype {src.dtype}, expected numbers", path, weights={})
            parts.append(np.asarray(src.read(0, src.shape[0]), dtype=np.float64).reshape(-1, D))
    W = np.vstack(parts)
    if not np.isfinite(W).all():
        raise Refused("{weights} holds NaN or Inf", path, weights={})
    return W
