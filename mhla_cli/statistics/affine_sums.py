"""The token-wise affine block beside the MHLA: the sums of the features f = (x_wide, 1) of the query's UNREDUCED
token (docs/bias_terms.md, "The affine map of the wide token").

A fit in reduced coordinates sees the tokens x = P^T x_wide only through the MHLA's cubic features; the query's own
D wide coordinates carry much of a head's output (a token-wise affine map of them is what "Neural Block
Linearization" fits). `featurize(..., affine_from=WIDE)` reads the wide tokens file that `mhla reduce` read, in
lockstep with the reduced one (the same chunks: `WideSource.chunks`), and appends f_b = A_w^T f (D + 1 values, at
the query of every sample: the last token, or every position) to the targets of the one pass, so that its sums
hold, beside the MHLA's (mhla_cli.statistics.accumulate):

    cross   = sum w Ht f_b^T   (nf, D + 1)  rows in the MHLA's canonical coordinates (as basis_moments)
    gram    = sum w f_b f_b^T  (D + 1, D + 1)
    moments = sum w f_b y^T    (D + 1, e)   (None without targets)
    total   = sum w f_b        (D + 1,)

A_w (`basis`) is an estimate of the whitening of f from a fixed sample of the wide file (`WideSource.estimate_basis`,
as the tokens' basis is estimated: mhla_cli.statistics.basis): the sums are accumulated in nearly whitened
coordinates, so that the certificate's whitening of the block afterwards (mhla_cli.solve.affine_block) is well
conditioned whatever the scales of the wide coordinates (a hidden state's outlier dimensions): whitening the raw
sums after the fact would multiply their rounding by cond(f)^2 and could lift an exact null direction above the
threshold.

`AffineSums` is that record: a sum over samples like every field of a Features (mhla_cli.statistics.features),
whose rows change with the MHLA's basis (`map_rows`). The certificate and the fit of the extended features are
mhla_cli.solve.affine_block. The wide tokens' file must be the one the reduced file was made from: `WideSource`
checks the reduced file's provenance (its recorded input's content fingerprint, `mhla reduce`) and its layout, and
every wide window as the pass reads it against the fingerprint of that window `mhla reduce` recorded
(formats.window_digests): a file edited, permuted or replaced anywhere is refused, whatever its size.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from mhla_cli.statistics import basis as basis_mod
from mhla_cli.errors import InputError, Refused
from mhla_cli.numerics import SINGULAR_BASIS_COND
from mhla_cli.io import formats
from mhla_cli.io.tokens import TokensInfo, check_finite, inspect_tokens, iter_chunks
from mhla_cli.samples import LAST, Samples

__all__ = ["AFFINE_DATASETS", "AffineSums", "WideSource", "affine_rows", "read_affine", "split_targets"]

# Bytes of the rows f (float64) read per chunk while the basis of f is estimated (`WideSource.estimate_basis`).
ESTIMATE_CHUNK_BYTES = 16 << 20
# The datasets of a features file with the affine block (docs/formats_features.md), and its attributes.
AFFINE_DATASETS = ("affine_cross", "affine_gram", "affine_moments", "affine_sum")
# The scopes of a recorded fingerprint (formats.source_identity) that cover all of a file's data.
COMPLETE_SCOPES = ("all data", "all bytes")


@dataclass
class AffineSums:
    """The affine block's sums (module docstring); `width` D (f = (x_wide, 1) has D + 1 entries) and `source`, the
    identity of the wide tokens file (formats.source_identity), or None."""

    cross: np.ndarray
    gram: np.ndarray
    moments: np.ndarray | None
    total: np.ndarray
    width: int
    source: dict[str, Any] | None = None
    # the reduction's P (D, d) of the reduced tokens x = P^T x_wide (`mhla reduce`'s reduce_P), or None
    P: np.ndarray | None = None
    # the basis A_w (D + 1, D + 1) the sums are of (f_b = A_w^T f; module docstring); None: f itself
    basis: np.ndarray | None = None

    def copy(self) -> AffineSums:
        def opt(a: np.ndarray | None) -> np.ndarray | None:
            return None if a is None else np.array(a)

        return AffineSums(np.array(self.cross), np.array(self.gram), opt(self.moments), np.array(self.total),
                          self.width, None if self.source is None else dict(self.source), opt(self.P), opt(self.basis))

    def zeros_like(self) -> AffineSums:
        return AffineSums(np.zeros_like(self.cross), np.zeros_like(self.gram),
                          None if self.moments is None else np.zeros_like(self.moments), np.zeros_like(self.total),
                          self.width, self.source, self.P, self.basis)

    @property
    def f_basis(self) -> np.ndarray:
        """A_w: the sums are of f_b = A_w^T f (the identity when accumulated on f itself)."""
        return np.eye(self.width + 1) if self.basis is None else self.basis

    def to_f_basis(self, A: np.ndarray) -> None:
        """In place: the sums of f_b' = A^T f instead (exact up to rounding: f_b' = C^T f_b, C = A_w^-1 A)."""
        if np.array_equal(self.f_basis, A):
            return
        C = np.linalg.solve(self.f_basis, A)
        self.cross = self.cross @ C
        self.gram = C.T @ self.gram @ C
        self.gram = 0.5 * (self.gram + self.gram.T)
        self.total = C.T @ self.total
        if self.moments is not None:
            self.moments = C.T @ self.moments
        self.basis = np.array(A)

    def map_rows(self, fn: Callable[[np.ndarray], np.ndarray]) -> None:
        """In place: the cross sums' rows (the MHLA's features) through `fn`, as the MHLA's moments are changed
        (a change of basis, the data's spans)."""
        self.cross = np.ascontiguousarray(fn(self.cross))

    def add(self, other: AffineSums, sign: float = 1.0) -> None:
        """In place: self += sign * other (the same rows: one basis and block of the MHLA's features; other's f
        basis changed to self's when they differ)."""
        if not np.array_equal(self.f_basis, other.f_basis):
            other = other.copy()
            other.to_f_basis(self.f_basis)
        self.cross += sign * other.cross
        self.gram += sign * other.gram
        self.total += sign * other.total
        if self.moments is not None:
            assert other.moments is not None  # parts of the same data have the same sums
            self.moments += sign * other.moments

    def check_addable(self, other: AffineSums | None) -> None:
        """Refuse sums of different wide tokens (width or source)."""
        if other is None:
            raise Refused("cannot add statistics with and without the affine block ({affine_from}): featurize every "
                          "part with the same {affine_from}", affine_from={})
        if other.width != self.width:
            raise InputError(f"cannot add affine blocks of wide tokens of width {self.width} and {other.width}")
        a, b = (self.source or {}).get("fingerprint"), (other.source or {}).get("fingerprint")
        if a is not None and b is not None and a != b:
            raise InputError("cannot add affine blocks of different wide tokens files (their fingerprints differ)")

    def datasets(self) -> dict[str, np.ndarray | None]:
        """The features file's datasets (AFFINE_DATASETS, and affine_reduce_P when known)."""
        return {"affine_cross": self.cross, "affine_gram": self.gram, "affine_moments": self.moments,
                "affine_sum": self.total, "affine_reduce_P": self.P, "affine_basis": self.basis}

    def attrs(self) -> dict[str, Any]:
        out: dict[str, Any] = {"affine_width": int(self.width)}
        if self.source is not None:
            out["affine_source"] = json.dumps(self.source)
        return out


def read_affine(f: Any, path: str | os.PathLike, nf: int, n_targets: int | None) -> AffineSums | None:
    """The affine block of an open features file (None without one), validated: `nf` rows of the MHLA's features
    (all psi, or the block on the data's spans), `n_targets` the targets' width (None: no targets)."""
    have = [k for k in AFFINE_DATASETS if k in f]
    if not have and "affine_width" not in f.attrs:
        return None
    need = [k for k in AFFINE_DATASETS if k != "affine_moments" or n_targets is not None]
    missing = [k for k in [*need, "affine_width"] if k not in f and k not in f.attrs]
    if missing:
        raise InputError(f"holds the affine block ({', '.join(have) or 'affine_width'}) but no "
                         f"{', '.join(repr(k) for k in missing)}; the file is incomplete", path)
    D = formats.read_attr_int(f, "affine_width", path)
    a = D + 1
    arrays = {k: formats.read_array(f, k, path).astype(np.float64) for k in need}
    shapes = {"affine_cross": (nf, a), "affine_gram": (a, a), "affine_sum": (a,)}
    if n_targets is not None:
        shapes["affine_moments"] = (a, n_targets)
    for k, shape in shapes.items():
        if arrays[k].shape != shape:
            raise InputError(f"'{k}' has shape {arrays[k].shape}, expected {shape}", path)
    P = None
    if "affine_reduce_P" in f:
        P = formats.read_array(f, "affine_reduce_P", path).astype(np.float64)
        if P.ndim != 2 or P.shape[0] != D:
            raise InputError(f"'affine_reduce_P' has shape {P.shape}, expected ({D}, d)", path)
    basis = None
    if "affine_basis" in f:
        basis = formats.read_array(f, "affine_basis", path).astype(np.float64)
        if basis.shape != (a, a) or not np.isfinite(basis).all() or np.linalg.cond(basis) > SINGULAR_BASIS_COND:
            raise InputError(f"'affine_basis' has shape {basis.shape} or is singular, expected an invertible "
                             f"({a}, {a})", path)
    source = None
    if "affine_source" in f.attrs:
        try:
            source = json.loads(_text(f.attrs["affine_source"]))
        except ValueError:
            raise InputError("attribute 'affine_source' is not valid JSON; the file is corrupted", path) from None
    return AffineSums(arrays["affine_cross"], arrays["affine_gram"], arrays.get("affine_moments"),
                      arrays["affine_sum"], D, source, P, basis)


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def affine_rows(wide: np.ndarray, offsets: np.ndarray, samples: Samples) -> np.ndarray:
    """f = (x_wide, 1) at the query of every sample of a chunk (float64): every token for per-position samples,
    the last token of each sequence for last-token ones."""
    X = np.asarray(wide, dtype=np.float64)
    if not samples.per_position:
        X = X[np.asarray(offsets[1:], dtype=np.int64) - 1]
    return np.hstack([X, np.ones((X.shape[0], 1))])


def split_targets(moments: np.ndarray | None, target_gram: np.ndarray | None, target_sum: np.ndarray | None,
                  n_targets: int, has_targets: bool
                  ) -> tuple[Any, Any, Any, tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray]]:
    """The sums of a pass whose targets were [y, f] split into those of y (moments, target_gram,
    target_sum; None without targets) and the affine block's (cross, gram, moments (a, e) or None, total)."""
    e = n_targets
    assert moments is not None and target_gram is not None and target_sum is not None  # f is a target of the pass
    cross, gram, total = moments[:, e:], target_gram[e:, e:], target_sum[e:]
    if not has_targets:
        return None, None, None, (cross, gram, None, total)
    return (moments[:, :e].copy(), target_gram[:e, :e].copy(), target_sum[:e].copy(),
            (cross, gram, target_gram[e:, :e].copy(), total))


@dataclass(frozen=True)
class WideSource:
    """The wide tokens file read in lockstep with a reduced one (module docstring): its layout (tokens only) and
    identity. `open` checks that the reduced file was made from it."""

    info: TokensInfo
    identity: dict[str, Any]
    P: np.ndarray | None = None  # the reduction's map (D, d): the reduced tokens are x_wide P
    basis: np.ndarray | None = None  # A_w (D + 1, D + 1): the rows f_b = A_w^T f (`estimate_basis`); None: f
    # the reduced tokens file recording the digest of every wide window (formats.REDUCE_DIGESTS), checked by
    # `chunks`; None: nothing to check (the data's own tokens, or a reduced file fingerprinted over all data)
    digests: str | None = None

    @property
    def width(self) -> int:
        return int(self.info.d)

    @classmethod
    def open(cls, wide: str | os.PathLike, reduced: str | os.PathLike) -> WideSource:
        """The wide tokens file `wide` of the reduced tokens file `reduced`: refused (InputError, one line) unless
        `reduced` was written by `mhla reduce` from it (the content fingerprint of its recorded input) with the same
        sequences. Every window is then checked as it is read (`chunks`: the digests `mhla reduce` recorded of
        each window it read); a reduced file that records none (an older mhla) is taken only when its recorded
        fingerprint covers all of the wide file's data."""
        red = inspect_tokens(reduced)
        with formats.open_input(reduced) as f:
            if "reduce_P" not in f:
                raise Refused("records no reduction (no dataset 'reduce_P'): {affine_from} needs the output of "
                              "mhla reduce and the tokens file it read", reduced, affine_from={})
            try:
                inputs = json.loads(_text(f.attrs.get("mhla_inputs", "[]")))
            except ValueError:
                inputs = []
            P = formats.read_array(f, "reduce_P", reduced).astype(np.float64)
            digests = f.get(formats.REDUCE_DIGESTS)
            has_digests = digests is not None and tuple(digests.shape) == (red.n_samples, 2)
        ident = formats.source_identity(wide)
        made_from = inputs[0] if inputs and isinstance(inputs[0], dict) else {}
        keys = ("fingerprint", "fingerprint_scope")
        if not made_from.get("fingerprint") or any(made_from.get(k) != ident.get(k) for k in keys):
            raise Refused(f"was reduced from {made_from.get('name', '?')} (fingerprint "
                          f"{str(made_from.get('fingerprint', '?'))[:12]}), not from {wide} (fingerprint "
                          f"{str(ident['fingerprint'])[:12]}): {{affine_from}} takes the tokens file mhla reduce read",
                          reduced, affine_from={})
        if not has_digests and made_from.get("fingerprint_scope") not in COMPLETE_SCOPES:
            raise Refused(f"records only a sampled fingerprint of {made_from.get('name', '?')} (an older mhla "
                          "reduce) and no fingerprint of each of its windows: make it again with {like} and use "
                          "NEW.h5", reduced, like={"wide": str(wide), "reduced": str(reduced)})
        info = inspect_tokens(wide)
        if (info.n_samples, info.n_tokens) != (red.n_samples, red.n_tokens):
            raise InputError(f"has {info.n_samples} sequences of {info.n_tokens} tokens but {reduced} has "
                             f"{red.n_samples} of {red.n_tokens}", wide)
        # tokens only: its targets (a head's wide outputs) and weights are the reduced file's business
        if P.ndim != 2 or P.shape[0] != info.d:
            raise InputError(f"its reduction maps D = {P.shape[0]} but {wide} has tokens of width {info.d}", reduced)
        return cls(replace(info, has_targets=False, has_weights=False, samples=LAST, d_out=None), ident, P,
                   digests=os.path.abspath(reduced) if has_digests else None)

    def chunks(self, sample_range: tuple[int, int], chunk_size: int, prefetch: bool = True
               ) -> Iterator[tuple[int, int, np.ndarray, np.ndarray]]:
        """(a, b, wide tokens, offsets) of the chunks of samples [lo, hi), the chunks `iter_chunks` gives the reduced
        file for the same sample range and size; the tokens checked for NaN, Inf and overflow, and every window
        against the digest `mhla reduce` recorded of it (`digests`), in this one pass."""
        with contextlib.ExitStack() as stack:
            recorded = None
            if self.digests is not None:
                recorded = stack.enter_context(formats.open_input(self.digests))[formats.REDUCE_DIGESTS]
            for a, b, tokens, offsets, _ in iter_chunks(self.info, sample_range, chunk_size, prefetch):
                check_finite(tokens, offsets, None, a, self.info.path)
                if recorded is not None:
                    self._check_windows(a, formats.window_digests(tokens, offsets), recorded[a:b])
                yield a, b, tokens, offsets

    def _check_windows(self, a: int, have: np.ndarray, want: np.ndarray) -> None:
        """Refuse wide windows whose digests differ from those `mhla reduce` recorded (first one named)."""
        bad = np.flatnonzero((have != want).any(axis=1))
        if bad.size:
            raise Refused(f"window {a + int(bad[0])} (and {bad.size - 1} more of samples {a}..{a + len(have) - 1})"
                          f" is not the window mhla reduce read to make {self.digests} (its content fingerprint "
                          "differs): {affine_from} takes the tokens file mhla reduce read, unchanged",
                          self.info.path, affine_from={})

    def rows(self, chunk: tuple[int, int, np.ndarray, np.ndarray], a: int, offsets: np.ndarray,
             samples: Samples, raw: bool = False) -> np.ndarray:
        """`affine_rows` of the wide chunk that goes with the reduced chunk starting at sample `a` with `offsets`
        (refused when the two files' sequences differ there), in the basis (f_b = A_w^T f) unless `raw`."""
        wa, _, wide, woff = chunk
        if wa != a or not np.array_equal(woff, offsets):
            raise InputError(f"its sequences differ from the reduced file's at samples from {a} on (offsets)",
                             self.info.path)
        f = affine_rows(wide, offsets, samples)
        return f if raw or self.basis is None else f @ self.basis

    def estimate_basis(self, samples: Samples) -> np.ndarray:
        """An estimate of the whitening of f = (x_wide, 1) at the samples' queries, from the fixed sample of the file
        that the tokens' basis is estimated from (basis.sample_blocks: the same whatever the shard, chunk size or
        worker count), rounded to float32 values: the sums are accumulated in it (module docstring)."""
        info = self.info
        D = info.d
        G = np.zeros((D + 1, D + 1))
        count = 0
        mean_len = max(1.0, info.n_tokens / max(info.n_samples, 1))
        size = max(1, int(ESTIMATE_CHUNK_BYTES // (8 * (D + 1) * mean_len)))  # the rows of f in float64
        for lo, hi in basis_mod.sample_blocks(info.n_samples, info.n_tokens):
            for _, _, wide, off in self.chunks((lo, hi), size, prefetch=False):
                X = np.asarray(wide if samples.per_position else wide[off[1:] - 1], dtype=np.float64)
                # sum f f^T of f = (x, 1), without forming f
                G[:D, :D] += X.T @ X
                G[:D, D] += X.sum(axis=0)
                G[D, D] += X.shape[0]
                count += X.shape[0]
        G[D, :D] = G[:D, D]
        return basis_mod.whitening(G, count, round32=True)
