"""Wide tokens to d dimensions: `mhla reduce DATA -o OUT --dim d` (and `--like OUT` for held-out data).

A transformer's hidden states are D = 384..4096 wide, and the MHLA's psi = d^2 (d + 1) / 2 features
fit in memory only for d of a few dozen. One streaming pass accumulates the uncentered second moments
of the tokens, sum x x^T (D x D, float64, every token), and of the targets, sum y y^T (D_out x D_out,
every target row: per sequence or per position, as the file holds them); the maps P (D x d) and
U (D_out x d) are their top-d eigenvectors (LAPACK's symmetric eigensolver, descending), each column
signed so that its largest-magnitude entry (the first of equal ones) is positive. The output is a
tokens file of the same layout, offsets and weights with tokens X P and targets Y U (float64), and it
records both maps (datasets `reduce_P`, `reduce_U`) and the share of each second moment's trace that
they keep. `reduce_tokens(..., like=OUT)` applies the maps stored in OUT, bit for bit, to other data
(held-out texts), so that a head fitted on OUT is evaluated in the same coordinates.

Uncentered on purpose: the MHLA is a homogeneous cubic in x, and x~ = P^T x keeps it one (a centring
would add lower-degree terms). A head fitted in reduced coordinates is a head of the original widths,
V_full = U V_h P^T and Q_full = P Q_h P^T (`unreduce_heads`, `mhla export-heads --unreduce`), kept factored as
the reduced heads and the maps P, U so that evaluating them costs what the reduced heads cost.
Memory: one chunk of the input, the two second moments and their eigensolver copies:
O(chunk + D^2 + D_out^2).

`--method` chooses P (U is the targets' top eigenvectors whatever the method): `pca` (the default, above),
`supervised` (the top-d input directions of the token-wise least-squares map from the tokens to the targets in the
tokens' whitened metric, from sum w x x^T and sum w x y^T over the scored samples: `scored_moments`) and `weights`
(the directions that keep W x in mean square over every token, W the matrices a head reads the token through);
mhla_cli.model.directions has their math. Their P is not orthonormal (P^T C P = I instead): the reduced tokens are
still z = P^T x, and the heads put back (V = U V_h P^T, Q = P Q_h P^T) compute on x what the reduced heads compute
on z, whatever P. The method and what its share is a share of are recorded (`reduce_method`, `reduce_share_of`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..io import formats
from ..errors import InputError, Refused
from . import directions
from .heads import Heads
from ..io.tokens import TokensInfo, check_finite, check_weights, inspect_tokens, iter_chunks

if TYPE_CHECKING:
    import h5py

__all__ = ["METHODS", "Reduction", "check_unreduce", "fit_reduction", "load_reduction", "reduce_tokens",
           "scored_moments", "second_moments", "top_eigenvectors", "unreduce_heads"]

# Bytes of token rows (float64) read per chunk of a reduction pass (at least one sequence).
CHUNK_BYTES = 16 << 20
# Rows of offsets / weights copied per block.
_BLOCK = 1 << 20
# The methods of `mhla reduce --method` and what the share each records (`reduce_token_share`) is a share of.
# The attribute of a reduced file whose targets were kept at their own width (no targets' map 'reduce_U').
KEPT_ATTR = "reduce_keeps_targets"

METHODS = {"pca": "the tokens' second moment",
           "supervised": "the mean square of the linear read's prediction of the targets",
           "weights": "the mean square of W x over the tokens"}


@dataclass(frozen=True)
class Reduction:
    """The maps of a reduction: tokens x -> P^T x (P: D x d), targets y -> U^T y (U: D_out x d; None
    without targets), and the shares of the second moments' traces they keep (None: not known, e.g.
    maps given by the caller). `dim`: the reduced dimension d. `load_reduction` reads them from a reduced
    file; `unreduce_heads` gives heads of the reduced tokens in the original widths."""

    P: np.ndarray
    U: np.ndarray | None
    token_share: float | None = None
    target_share: float | None = None
    source: str | None = None  # the file the maps were fitted on
    method: str = "pca"  # how P was chosen (METHODS); token_share is a share of METHODS[method]
    weights: str | None = None  # the --weights file of method "weights"
    keep_targets: bool = False  # the targets copied unreduced (U None): the fit is at their full width D_out

    @property
    def dim(self) -> int:
        """The reduced dimension d."""
        return int(self.P.shape[1])

    def __repr__(self) -> str:
        u = "none" if self.U is None else f"{self.U.shape[0]} x {self.U.shape[1]}"
        return (f"Reduction(P {self.P.shape[0]} x {self.P.shape[1]}, U {u}, method={self.method}, "
                f"token_share={self.token_share}, target_share={self.target_share})")


def _chunk(info: TokensInfo, chunk_size: int | None) -> int:
    """Sequences per chunk: about CHUNK_BYTES of float64 token rows (at least one sequence)."""
    if chunk_size:
        return int(chunk_size)
    mean_len = max(1.0, info.n_tokens / max(1, info.n_samples))
    return max(1, int(CHUNK_BYTES // (8 * mean_len * max(info.d, info.out_dim))))


def second_moments(data: str | os.PathLike, chunk_size: int | None = None,
                   progress: Callable[[int], None] | None = None
                   ) -> tuple[np.ndarray, np.ndarray | None, TokensInfo]:
    """(sum x x^T over every token (D, D), sum y y^T over every target row (D_out, D_out) or None,
    the file's layout): one streaming pass in float64, validated chunk by chunk (NaN, Inf)."""
    info = inspect_tokens(data)
    Gx = np.zeros((info.d, info.d))
    Gy = np.zeros((info.out_dim, info.out_dim)) if info.has_targets else None
    for a, b, tokens, offsets, targets in iter_chunks(info, (0, info.n_samples), _chunk(info, chunk_size)):
        check_finite(tokens, offsets, targets, a, data)
        X = np.asarray(tokens, dtype=np.float64)
        Gx += X.T @ X
        if Gy is not None and targets is not None:
            Y = np.asarray(targets, dtype=np.float64)
            Gy += Y.T @ Y
        if progress is not None:
            progress(b - a)
    return Gx, Gy, info


def scored_moments(data: str | os.PathLike, chunk_size: int | None = None,
                   progress: Callable[[int], None] | None = None
                   ) -> tuple[np.ndarray, np.ndarray, float, np.ndarray, TokensInfo]:
    """(sum w x x^T (D, D) and sum w x y^T (D, D_out) over the scored samples: the query token x, target y and weight
    w of every sample of the file's layout (the last token of each sequence, or every position); the sum of their
    weights; sum y y^T over every target row as `second_moments`; the file's layout): one streaming pass, float64."""
    info = inspect_tokens(data)
    if not info.has_targets:
        raise Refused("{method:supervised} needs targets (the directions of the tokens that predict them): the "
                      "file has none; use {method:pca} or {method:weights}", data, method={})
    Cxx, Cxy = np.zeros((info.d, info.d)), np.zeros((info.d, info.out_dim))
    Gy, wsum = np.zeros((info.out_dim, info.out_dim)), 0.0
    for a, b, tokens, offsets, targets, weights in iter_chunks(info, (0, info.n_samples), _chunk(info, chunk_size),
                                                               with_weights=True):
        check_finite(tokens, offsets, targets, a, data)
        check_weights(weights, offsets, a, info.per_position, data)
        X, Y = np.asarray(tokens, dtype=np.float64), np.asarray(targets, dtype=np.float64)
        _, rows, w = info.samples.token_weights(offsets, weights)
        Xq = X if rows is None else X[rows]
        Xw = Xq if w is None else Xq * w[:, None]
        Cxx += Xw.T @ Xq
        Cxy += Xw.T @ Y
        Gy += Y.T @ Y
        wsum += float(Xq.shape[0] if w is None else w.sum())
        if progress is not None:
            progress(b - a)
    return Cxx, Cxy, wsum, Gy, info


def top_eigenvectors(G: np.ndarray, k: int) -> tuple[np.ndarray, float]:
    """The top-k eigenvectors (columns, eigenvalues descending) of a symmetric positive semi-definite
    G, each signed so that its largest-magnitude entry (the first of equal ones) is positive, and the
    share of trace(G) their eigenvalues hold (1.0 for G = 0)."""
    G = np.asarray(G, dtype=np.float64)
    D = G.shape[0]
    if not 1 <= k <= D:
        raise InputError(f"cannot keep {k} of {D} dimensions")
    w, V = np.linalg.eigh(0.5 * (G + G.T))  # LAPACK syevd, ascending
    top = V[:, ::-1][:, :k]
    rows = np.argmax(np.abs(top), axis=0)
    signs = np.where(top[rows, np.arange(k)] < 0, -1.0, 1.0)
    top = np.ascontiguousarray(top * signs)
    total = float(np.clip(w, 0, None).sum())
    share = 1.0 if total == 0 else float(np.clip(w[::-1][:k], 0, None).sum() / total)
    return top, share


def _check_dim(dim: int, info: TokensInfo, path: str | os.PathLike, keep_targets: bool = False) -> None:
    if dim < 1:
        raise Refused(f"{{dim_opt}} must be >= 1, got {dim}", dim_opt={})
    if dim > info.d:
        raise Refused(f"{{dim:{dim}}} is more than the tokens' width D = {info.d}: a reduction keeps at most D "
                      "dimensions", path, dim={})
    if info.has_targets and dim > info.out_dim and not keep_targets:  # kept targets: any width
        raise Refused(f"{{dim:{dim}}} is more than the targets' width D_out = {info.out_dim}: the MHLA maps R^d "
                      f"to R^d, so the targets need at least d dimensions (use {{dim_opt}} <= {info.out_dim})", path,
                      dim={}, dim_opt={})


def fit_reduction(data: str | os.PathLike, dim: int, chunk_size: int | None = None,
                  progress: Callable[[int], None] | None = None, method: str = "pca",
                  weights: str | os.PathLike | None = None, keep_targets: bool = False) -> Reduction:
    """The maps P, U of `data` to `dim` dimensions: U the targets' top eigenvectors, P by `method` (METHODS: the
    tokens' top eigenvectors; `supervised`; `weights`, reading the matrices of the file `weights`).
    `keep_targets`: no U, the targets are kept at their own width D_out (only the tokens are reduced)."""
    info = inspect_tokens(data)
    _check_method(method, weights)
    _check_dim(dim, info, data, keep_targets)
    if method == "supervised":
        Cxx, Cxy, wsum, Gt, info = scored_moments(data, chunk_size, progress)
        if not wsum > 0:
            raise Refused("every sample weighs 0: {method:supervised} has no scored sample", data, method={})
        P, ps = directions.supervised(Cxx / wsum, Cxy / wsum, dim, data)
        Ut, uts = (None, None) if keep_targets else top_eigenvectors(Gt, dim)
        return Reduction(P, Ut, ps, uts, str(data), method, keep_targets=keep_targets)
    W = None if weights is None else directions.load_read_weights(weights, info.d)
    Gx, Gy, info = second_moments(data, chunk_size, progress)
    if W is None:
        P, ps = top_eigenvectors(Gx, dim)
    else:
        P, ps = directions.weight_directions(W, Gx / max(1, info.n_tokens), dim, data)
    U, us = (None, None) if Gy is None or keep_targets else top_eigenvectors(Gy, dim)
    return Reduction(P, U, ps, us, str(data), method, None if weights is None else str(weights), keep_targets)


def _check_method(method: str, weights: str | os.PathLike | None) -> None:
    if method not in METHODS:
        raise Refused(f"{{method_opt}} {method!r}: expected one of {', '.join(METHODS)}", method_opt={})
    if (method == "weights") != (weights is not None):
        raise Refused("{method:weights} needs {weights_file} (the matrices the head reads the token through)"
                      if weights is None else f"{{weights}} goes with {{method:weights}}, not {{method:{method}}}",
                      method={}, weights_file={}, weights={})


def load_reduction(path: str | os.PathLike) -> Reduction:
    """The maps recorded in a reduced tokens file (the output of `reduce_tokens`)."""
    with formats.open_input(path) as f:
        formats.expect_kind(f, path, "tokens")
        if "reduce_P" not in f:
            raise InputError("records no reduction (no dataset 'reduce_P'): give the output of mhla reduce", path)
        P = formats.read_array(f, "reduce_P", path).astype(np.float64, copy=False)
        U = formats.read_array(f, "reduce_U", path).astype(np.float64, copy=False) if "reduce_U" in f else None
        method = f.attrs.get("reduce_method", "pca")
        method = method.decode() if isinstance(method, bytes) else str(method)
        wsrc = f.attrs.get("reduce_weights")
        ts = f.attrs.get("reduce_token_share")
        us = f.attrs.get("reduce_target_share")
        src = f.attrs.get("reduce_source")
        kept = f.attrs.get(KEPT_ATTR, 0)
        if kept not in (0, 1) or (kept and U is not None):
            raise InputError(f"attribute '{KEPT_ATTR}' is {kept!r} beside 'reduce_U' {U is not None}, expected 1 "
                             "without 'reduce_U' or 0; the file is corrupted", path)
    if P.ndim != 2 or (U is not None and (U.ndim != 2 or U.shape[1] != P.shape[1])):
        raise InputError(f"'reduce_P' {P.shape} and 'reduce_U' {None if U is None else U.shape} are not maps to one "
                         "dimension d; the file is corrupted", path)
    if method not in METHODS:
        raise InputError(f"attribute 'reduce_method' is {method!r}, expected one of {', '.join(METHODS)}", path)
    return Reduction(P, U, None if ts is None else float(ts), None if us is None else float(us),
                     None if src is None else str(src), method, None if wsrc is None else str(wsrc), bool(kept))


def _check_like(red: Reduction, info: TokensInfo, data: str | os.PathLike, like: str | os.PathLike) -> None:
    if red.P.shape[0] != info.d:
        raise InputError(f"the tokens have width D = {info.d} but the reduction of {like} maps D = {red.P.shape[0]}",
                         data)
    if info.has_targets and not red.keep_targets:
        if red.U is None:
            raise InputError(f"the data have targets but the reduction of {like} has no targets' map", data)
        if red.U.shape[0] != info.out_dim:
            raise InputError(f"the targets have width D_out = {info.out_dim} but the reduction of {like} maps "
                             f"D_out = {red.U.shape[0]}", data)


def apply_reduction(red: Reduction, data: str | os.PathLike, out: str | os.PathLike, chunk_size: int | None = None,
                    progress: Callable[[int], None] | None = None, like: str | os.PathLike | None = None
                    ) -> TokensInfo:
    """Write `out` (atomically): the tokens file `data` with tokens X P and targets Y U (float64), the
    same layout, offsets and weights, recording the maps and their shares. Returns its layout."""
    info = inspect_tokens(data)
    _check_like(red, info, data, like or "the maps")
    formats.check_hdf5_suffix(out, "a tokens file")
    inputs: tuple[str | os.PathLike, ...] = (data,) if like is None else (data, like)
    if like is None and red.weights is not None:  # the --weights file: recorded with its fingerprint
        inputs += (red.weights,)
    o = formats.check_output_path(out, inputs, "tokens")
    d = red.dim
    N, T = info.n_samples, info.n_tokens
    dense = info.layout == "dense"
    with formats.atomic_path(o) as tmp:
        with formats.create_output(tmp) as fout, formats.open_input(data) as fin:
            _write_maps(fout, red, inputs, data)
            if info.attention is not None:  # how the per-position samples read the window: kept
                fout.attrs["attention"] = info.attention
            if formats.COMPAT_ATTR in fin.attrs:  # the TransformerLens mode the activations were captured in: kept
                fout.attrs[formats.COMPAT_ATTR] = fin.attrs[formats.COMPAT_ATTR]
            n = info.dense_len if dense else 0
            dt = fout.create_dataset("tokens", (N, n, d) if dense else (T, d), dtype="f8")
            dy = None
            if info.has_targets:
                e = info.out_dim if red.keep_targets else d  # the targets' width in OUT
                shape = ((N, n, e) if dense else (T, e)) if info.per_position else (N, e)
                dy = fout.create_dataset("targets", shape, dtype="f8")
            for name in ("offsets", "weights"):
                if name in fin:
                    src = fin[name]
                    dst = fout.create_dataset(name, src.shape, dtype=src.dtype)
                    for a in range(0, src.shape[0], _BLOCK):
                        dst[a:a + _BLOCK] = src[a:a + _BLOCK]
            digests = fout.create_dataset(formats.REDUCE_DIGESTS, (N, 2), dtype="<u8")
            _reduce_chunks(red, info, data, dt, dy, _chunk(info, chunk_size), progress, digests)
        written = inspect_tokens(tmp)
    return dataclasses.replace(written, path=str(o))


def _write_maps(fout: h5py.File, red: Reduction, inputs: tuple[str | os.PathLike, ...],
                data: str | os.PathLike) -> None:
    """The header of a reduced tokens file: provenance, the dimension, the source, the shares and the maps."""
    for k, v in formats.header("tokens", inputs).items():
        fout.attrs[k] = v
    fout.attrs["reduce_dim"] = red.dim
    fout.attrs["reduce_source"] = str(red.source if red.source is not None else data)
    fout.attrs["reduce_method"] = red.method
    fout.attrs["reduce_share_of"] = METHODS[red.method]
    if red.weights is not None:
        fout.attrs["reduce_weights"] = red.weights
    if red.token_share is not None:
        fout.attrs["reduce_token_share"] = red.token_share
    if red.target_share is not None:
        fout.attrs["reduce_target_share"] = red.target_share
    fout.create_dataset("reduce_P", data=red.P)
    if red.U is not None:
        fout.create_dataset("reduce_U", data=red.U)
    if red.keep_targets:
        fout.attrs[KEPT_ATTR] = 1


def _reduce_chunks(red: Reduction, info: TokensInfo, data: str | os.PathLike, dt: Any, dy: Any, size: int,
                   progress: Callable[[int], None] | None, digests: Any = None) -> None:
    """Stream `data` in chunks of `size` sequences into the datasets dt (tokens X P) and dy (targets Y U,
    None without targets), in the layout of the source (dense (N, n, d) or ragged (T, d)), and `digests` (N, 2)
    the fingerprint of every window of `data` read (formats.window_digests: --affine-from checks each)."""
    dense, d = info.layout == "dense", red.dim
    n = info.dense_len if dense else 0
    pos = 0
    for a, b, tokens, offsets, targets, weights in iter_chunks(info, (0, info.n_samples), size, with_weights=True):
        check_finite(tokens, offsets, targets, a, data)
        check_weights(weights, offsets, a, info.per_position, data)
        Z = np.asarray(tokens, dtype=np.float64) @ red.P
        if digests is not None:
            digests[a:b] = formats.window_digests(tokens, offsets)
        t = Z.shape[0]
        if dense:
            dt[a:b] = Z.reshape(b - a, n, d)
        else:
            dt[pos:pos + t] = Z
        if dy is not None and targets is not None:
            W = np.asarray(targets, dtype=np.float64)
            if not red.keep_targets:
                assert red.U is not None  # dy: the reduction maps the targets
                W = W @ red.U
            e = W.shape[1]
            if not info.per_position:
                dy[a:b] = W
            elif dense:
                dy[a:b] = W.reshape(b - a, n, e)
            else:
                dy[pos:pos + t] = W
        pos += t
        if progress is not None:
            progress(b - a)


def reduce_tokens(data: str | os.PathLike, out: str | os.PathLike, dim: int | None = None,
                  like: str | os.PathLike | None = None, chunk_size: int | None = None,
                  progress: Callable[[int], None] | None = None, method: str | None = None,
                  weights: str | os.PathLike | None = None, keep_targets: bool = False) -> Reduction:
    """`mhla reduce`: fit the maps of `data` to `dim` dimensions by `method` (METHODS; None: "pca"; "weights" reads
    the matrices of the file `weights`), or take those recorded in `like`, a reduced tokens file, and write the
    reduced tokens file `out`. Returns the maps applied.

    One streaming pass accumulates the uncentered second moments of the tokens (D x D) and of the targets
    (D_out x D_out), float64; their top-`dim` eigenvectors (LAPACK eigh, each signed so that its largest
    entry is positive) are the maps P (D x d) and U (D_out x d) of "pca". "supervised" takes P from the
    token-wise least-squares map to the targets in the tokens' whitened metric (reduced-rank regression, from
    sum w x x^T and sum w x y^T over the scored samples), "weights" the directions that keep W x in mean
    square (docs/tokens.md, "Which token directions"; the math in `mhla_cli.model.directions`). `out` holds the tokens X P, the targets Y U
    and both maps (`reduce_P`, `reduce_U`, with the shares of the second moments they keep); `like=` a
    reduced file applies its maps bit for bit (held-out data). `keep_targets`: the targets are copied at their own
    width D_out (no U; the fit is then at full output width, and `unreduce_heads` maps back only the tokens).

    `progress(n)` is told the sequences of each chunk (two passes when fitting: moments, then output).
    """
    if (dim is None) == (like is None):
        raise Refused("give exactly one of {dim_opt} (fit the maps on DATA) and {like_opt} (apply those of a reduced "
                      "file)", dim_opt={}, like_opt={})
    if like is not None:
        if keep_targets:
            raise InputError("keep_targets chooses the maps fitted on DATA; like applies those of a reduced file "
                             "(which records whether it kept the targets): give one or the other")
        if method is not None or weights is not None:
            raise Refused("{method_opt} and {weights} choose the maps fitted on DATA; {like_opt} applies those of a "
                          "reduced file (its method is recorded there): give one or the other", method_opt={},
                          weights={}, like_opt={})
        red = load_reduction(like)
    else:
        assert dim is not None
        _check_method(method or "pca", weights)
        formats.check_hdf5_suffix(out, "a tokens file")
        formats.check_output_path(out, (data,), "tokens")
        red = fit_reduction(data, int(dim), chunk_size, progress, method or "pca", weights, keep_targets)
    apply_reduction(red, data, out, chunk_size, progress, like)
    return red


def unreduce_heads(heads: Heads, red: Reduction, path: str | os.PathLike | None = None, dense: bool = False
                   ) -> Heads:
    """Heads of reduced coordinates as heads of the original widths: factored heads (the heads themselves and the
    maps P, U: `Heads.P`, `Heads.U`) computing y = U (the reduced heads' output on x~ = P^T x), so that on the
    original tokens X they give U (the reduced heads' output on X P) at the cost of the reduced heads. Their
    bias terms stay those of the reduced heads; the affine map of the wide tokens is mapped back, U
    affine_weight (D_out, D). `dense`: the same function as d x d matrices, V_full = U V_h P^T (H, D_out, D)
    and Q_full = P Q_h P^T (H, D, D) (`Heads.dense`). `path`: the reduced file, for messages. `predict`,
    `compare`, `save_heads` and `to_torch` take the factored heads."""
    if red.U is None and not red.keep_targets:
        raise InputError("records no targets' map 'reduce_U': the outputs cannot be mapped back", path)
    d = red.dim
    if heads.factored or heads.d != d or (heads.d_out != d and not red.keep_targets):
        raise InputError(f"the heads have d = {heads.d} but the reduction maps to d = {d}", path)
    # targets kept unreduced: the outputs are already in the model's coordinates (U = I)
    U = np.eye(heads.d_out) if red.U is None else red.U
    if U.shape[1] != heads.d_out:
        raise InputError(f"the heads have {heads.d_out}-dim outputs but the reduction maps targets to "
                         f"{U.shape[1]}", path)
    info = dict(heads.info)
    info["unreduced"] = str(path) if path is not None else "yes"
    affine = {}
    if heads.affine_weight is not None:  # the affine map of the wide tokens: its outputs mapped back by U
        assert heads.affine_bias is not None  # set with affine_weight
        affine = {"affine_weight": np.ascontiguousarray(U @ heads.affine_weight),
                  "affine_bias": np.ascontiguousarray(U @ heads.affine_bias)}
    out = Heads(V=np.array(heads.V), Q=np.array(heads.Q), info=info, P=np.ascontiguousarray(red.P),
                U=np.ascontiguousarray(U), **heads.bias_arrays(), **affine)
    return out.dense() if dense else out


def check_unreduce(model: Any, reduced: str | os.PathLike, model_path: str | os.PathLike) -> str | None:
    """Are the maps recorded in `reduced` the ones `model`'s training data were made with? The model records its
    data's identity (`Model.info["data_source"]`, with the fingerprint and width of the maps of the reduction that
    wrote them: formats.source_identity); a reduced file of another width, or with other maps (another `mhla reduce`
    run of the same d), is an InputError naming both files, and so is a model fitted on data that mhla reduce did
    not write. A model that records no data identity (an older mhla's, or fitted on statistics made in memory)
    cannot tell unless its recorded input is `reduced` itself: the warning text is returned (None when the maps are
    confirmed)."""
    ident = formats.source_identity(reduced)
    have = ident.get("reduction") or {}
    source = model.info.get("data_source")
    if isinstance(source, dict):
        fitted = source.get("reduction") or {}
        name = source.get("name", "?")
        if fitted.get("maps") is None:
            raise Refused(f"{model_path} was fitted on {name}, which mhla reduce did not write (it records no "
                          f"maps): its heads are not in the coordinates of {reduced}; {{unreduce_opt}} takes the file "
                          "mhla reduce wrote for the model's training data", reduced, unreduce_opt={})
        if fitted.get("dim") is not None and have.get("dim") is not None and fitted["dim"] != have["dim"]:
            raise InputError(f"the heads have d = {fitted['dim']} but the reduction maps to d = {have['dim']}",
                             reduced)
        if fitted["maps"] != have.get("maps"):
            raise Refused(f"holds other maps (reduce_P, reduce_U: {str(have.get('maps'))[:12]}) than the reduction "
                          f"of {name} that {model_path} was fitted on ({fitted['maps'][:12]}): give {{unreduce_opt}} "
                          f"{name}, or a file reduced with {{like_it}} it", reduced, unreduce_opt={}, like_it={})
        return None
    first = (formats.recorded_inputs(model_path)[:1] or [{}])[0]
    if first.get("fingerprint") and first.get("fingerprint") == ident.get("fingerprint"):
        return None  # an older model fitted on this very file
    return (f"{model_path} does not record which reduction its training data came from (a model of an older mhla, "
            f"or fitted on statistics made in memory): cannot check that {reduced} holds the maps it was fitted in; "
            "the heads of another mhla reduce run of the same d are wrong with no error (fit the model again with "
            "this mhla to have it checked)")
