"""The MHLA forward pass: last-token and all-position outputs, from coef p or from heads."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from . import formats
from .errors import InputError
from .features import features_from_moments, pair_index
from .heads import Heads
from .solve import Model
from .stream import default_chunk_size, sequence_moments, spans


def load_function(path: str | os.PathLike) -> Model | Heads:
    """Load a model or heads file."""
    kind = formats.kind_of(path)
    if kind == "model":
        return Model.load(path)
    if kind == "heads":
        return Heads.load(path)
    raise InputError(f"is a {kind} file, expected a model or heads file", path)


def coef_of(fn: Model | Heads | np.ndarray) -> np.ndarray:
    """The coef p (d, psi) of a model, heads or a p array."""
    if isinstance(fn, np.ndarray):
        return np.asarray(fn, dtype=np.float64)
    return fn.coef


def forward_heads(V: np.ndarray, Q: np.ndarray, X: np.ndarray, all_positions: bool = False) -> np.ndarray:
    """Reference forward pass of one sequence X (n, d): sum_h V_h X^T X Q_h x_t (t = n, or every t)."""
    X = np.asarray(X, dtype=np.float64)
    S = X.T @ X
    if all_positions:
        return np.einsum("hab,bc,hcl,tl->ta", V, S, Q, X, optimize=True)
    return np.einsum("hab,bc,hcl,l->a", V, S, Q, X[-1], optimize=True)


def predict_chunk(coef: np.ndarray, tokens: np.ndarray, offsets: np.ndarray,
                  all_positions: bool = False) -> tuple[np.ndarray, np.ndarray | None]:
    """Predictions for a chunk: last-token outputs (B, d) and, if asked, every position's (t, d)."""
    d = coef.shape[0]
    if tokens.shape[1] != d:
        raise InputError(f"the model has d = {d} but the data have d = {tokens.shape[1]}")
    S, last = sequence_moments(tokens, offsets)
    H = features_from_moments(S, last)
    pred = H @ coef.T
    outputs = None
    if all_positions:
        # Y_t = M_i x_t with M_i[a, l] = sum_{j<=k} p[a,(j,k,l)] S_i[j,k].
        j, k = pair_index(d)
        P = coef.reshape(d, j.size, d)
        M = np.einsum("bp,apl->bal", S[:, j, k], P, optimize=True)
        lengths = np.diff(offsets)
        seq = np.repeat(np.arange(lengths.size), lengths)
        X = np.asarray(tokens, dtype=np.float64)
        outputs = np.einsum("tal,tl->ta", M[seq], X, optimize=True)
    return pred, outputs


def predict(fn: Model | Heads | np.ndarray, tokens: np.ndarray, offsets: np.ndarray | None = None,
            all_positions: bool = False) -> np.ndarray | tuple[np.ndarray, np.ndarray]:
    """In-memory prediction. tokens (N, n, d), or (T, d) with offsets (N+1,)."""
    coef = coef_of(fn)
    tokens = np.asarray(tokens)
    if tokens.ndim == 3:
        N, n, d = tokens.shape
        offsets = np.arange(N + 1) * n
        tokens = tokens.reshape(-1, d)
    elif offsets is None:
        raise InputError("tokens of shape (T, d) need offsets")
    pred, outputs = predict_chunk(coef, tokens, np.asarray(offsets, dtype=np.int64), all_positions)
    return (pred, outputs) if all_positions else pred


def predict_file(fn: Model | Heads, data: str | os.PathLike, out: str | os.PathLike | None = None,
                 all_positions: bool = False, chunk_size: int | None = None,
                 progress: Callable[[int], None] | None = None,
                 inputs: tuple[str | os.PathLike, ...] = (), workers: int = 1,
                 map: Callable[..., Any] | None = None) -> dict[str, Any]:  # noqa: A002
    """Stream predictions over a tokens file; write them to `out` (atomically) if given.

    Returns a summary (n_samples, mse when the data have targets); without `out` the summary also
    holds the `predictions` array. `workers=K` predicts chunks in K local workers (or pass any
    ordered `map`); the output is the same as the serial one.
    """
    import dataclasses
    from functools import partial

    import h5py

    from .parallel import make_map, predict_span

    coef = coef_of(fn)
    d = coef.shape[0]
    info = formats.inspect_tokens(data)
    if info.d != d:
        raise InputError(f"the data have d = {info.d} but the model has d = {d}", data)
    size = chunk_size or default_chunk_size(info)
    sse = 0.0
    have_y = info.has_targets
    result: dict[str, Any] = {"n_samples": info.n_samples, "d": d}
    store = None if out is not None else np.empty((info.n_samples, d))

    def run(fout: h5py.File | None) -> None:
        nonlocal sse
        if fout is not None:
            dp = fout.create_dataset("predictions", (info.n_samples, d), dtype="f8")
            if all_positions:
                do = fout.create_dataset("outputs", (info.n_tokens, d), dtype="f8")
                doff = fout.create_dataset("offsets", (info.n_samples + 1,), dtype="i8")
                doff[0] = 0
        tok_pos = 0
        todo = spans(0, info.n_samples, size)
        with make_map(workers=workers, map=map) as pmap:
            # workers open the file themselves: give them an absolute path
            winfo = info if pmap.n_workers == 1 else dataclasses.replace(info, path=os.path.abspath(info.path))
            task = partial(predict_span, coef, winfo, all_positions)
            for (a, b), (pred, outputs, offsets, part_sse) in zip(todo, pmap(task, todo)):
                sse += part_sse
                if fout is not None:
                    dp[a:b] = pred
                    if all_positions:
                        do[tok_pos:tok_pos + outputs.shape[0]] = outputs
                        doff[a + 1:b + 1] = tok_pos + offsets[1:]
                else:
                    store[a:b] = pred
                tok_pos += int(offsets[-1])
                if progress is not None:
                    progress(b - a)

    if out is not None:
        o = formats.check_output_path(out, (data, *inputs))
        meta = {**formats.header("predictions", (data, *inputs)), "d": d, "n_samples": info.n_samples}
        with formats.atomic_path(o) as tmp:
            with formats.create_output(tmp) as fout:
                for k, v in meta.items():
                    fout.attrs[k] = v
                run(fout)
    else:
        run(None)
        result["predictions"] = store
    if have_y:
        result["mse"] = sse / (info.n_samples * d)
    return result
