"""Gradient-trained baselines for the paper's experiments: AdamW on MHLA and on multi-layer linear attention.

Not part of the `mhla` package (torch is the optional extra `bench`); the experiment scripts and
benchmarks/bench_vs_adamw.py import it:

    from experiments.mhla_torch import train_mhla, train_linear_attention
    res = train_mhla(tokens, targets, n_heads=16, epochs=400)     # tokens (N, n, d), targets (N, d)
    res["history"][-1], res["epochs_to"][1e-8], res["coef"]

Models (float64, tokens are rows, no softmax / normalisation / causal mask):

- MHLA with m heads: yhat(X) = sum_h V_h X^T X Q_h x_n. The forward pass uses S = X^T X, computed once
  per sequence before training: the same function and the same gradients as computing X^T (X Q_h x_n)
  every step, only cheaper. Ragged lengths are therefore free (pass offsets).
- Single-head linear attention with L layers (the paper's "more layers" baseline): residual stacking,
      X^(0) = X,  X^(l) = X^(l-1) + A_l(X^(l-1))  (l = 1..L-1),  yhat = A_L(X^(L-1))_n,
  with A_l(Z)_t = V_l Z^T Z Q_l z_t at every position t. L = 1 is exactly the 1-head MHLA; the final
  layer's last-token output (without the residual) is the prediction, so the target need not contain x_n.
  Needs equal lengths (tokens (N, n, d)).

Training: AdamW (torch.optim.AdamW) on the mean squared error over the N*d outputs, mini-batches of
`batch_size` reshuffled every epoch, weight decay 0 by default (any decay moves the minimiser away from
the teacher and puts a floor under the loss), optional cosine learning-rate decay. history[e] is the
full-data training MSE after epoch e+1 (evaluated in float64 on all N samples, not a running average).
Initialisation: V, Q entries N(0, s^2) with s chosen so that the initial outputs have RMS ~ init_rms
for Gaussian-like tokens of the data's scale.
"""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np

try:
    import torch
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("experiments.mhla_torch needs torch: pip install -e '.[bench]' in a clone "
                      "(torch==2.13.0, CPU build)") from exc

THRESHOLDS = (1e-4, 1e-8, 1e-12)


def sequence_stats(tokens: np.ndarray, offsets: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """S = X^T X (N, d, d) and last tokens (N, d) in float64, from (N, n, d) or (T, d) + offsets."""
    from mhla_cli.kernels import sequence_moments

    tokens = np.asarray(tokens, dtype=np.float64)
    if tokens.ndim == 3:
        N, n, d = tokens.shape
        return sequence_moments(tokens.reshape(N * n, d), np.arange(N + 1, dtype=np.int64) * n)
    if offsets is None:
        raise ValueError("tokens of shape (T, d) need offsets")
    return sequence_moments(tokens, np.asarray(offsets, dtype=np.int64))


def _epochs_to(history: list[float], thresholds: tuple[float, ...]) -> dict[float, int | None]:
    out: dict[float, int | None] = {}
    for t in thresholds:
        out[t] = next((e + 1 for e, v in enumerate(history) if v <= t), None)
    return out


def _init_scale(trace_s: float, d: int, width: int, init_rms: float, last_rms: float) -> float:
    # yhat ~ sum_h V_h S Q_h x with S ~ (tr S / d) I: RMS ~ s^2 * (tr S / d) * sqrt(width * d) * last_rms.
    gain = (trace_s / d) * math.sqrt(width * d) * max(last_rms, 1e-12)
    return math.sqrt(init_rms / max(gain, 1e-300))


def _run(params: list[torch.Tensor], loss_fn, full_mse, n: int, epochs: int, batch_size: int, lr: float,
         weight_decay: float, seed: int, target_mse: float | None, schedule: str, time_limit: float | None,
         eps: float, thresholds: tuple[float, ...]) -> dict[str, Any]:
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, eps=eps)
    steps_per_epoch = max(1, math.ceil(n / batch_size))
    total = epochs * steps_per_epoch
    sched = None
    if schedule == "cosine":
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, total) / total)))
    elif schedule != "constant":
        raise ValueError(f"schedule must be constant or cosine, got {schedule}")
    gen = torch.Generator().manual_seed(seed + 1)
    history: list[float] = []
    t0 = time.perf_counter()
    stopped = "epochs"
    for _ in range(epochs):
        perm = torch.randperm(n, generator=gen)
        for s in range(steps_per_epoch):
            idx = perm[s * batch_size:(s + 1) * batch_size]
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(idx)
            loss.backward()
            opt.step()
            if sched is not None:
                sched.step()
        with torch.no_grad():
            mse = float(full_mse())
        history.append(mse)
        if not math.isfinite(mse):
            stopped = "diverged"
            break
        if target_mse is not None and mse <= target_mse:
            stopped = "target_mse"
            break
        if time_limit is not None and time.perf_counter() - t0 > time_limit:
            stopped = "time_limit"
            break
    return {"history": history, "epochs_to": _epochs_to(history, thresholds),
            "seconds": time.perf_counter() - t0, "epochs_run": len(history), "stopped": stopped}


def train_mhla(tokens: np.ndarray, targets: np.ndarray, n_heads: int, epochs: int, batch_size: int = 64,
               lr: float = 1e-2, seed: int = 0, target_mse: float | None = None, *,
               offsets: np.ndarray | None = None, weight_decay: float = 0.0, schedule: str = "constant",
               init_rms: float = 0.1, eps: float = 1e-8, time_limit: float | None = None,
               thresholds: tuple[float, ...] = THRESHOLDS) -> dict[str, Any]:
    """AdamW on an m-head MHLA; returns history (per-epoch train MSE), epochs_to, seconds, params, coef.

    tokens (N, n, d), or (T, d) with `offsets`; targets (N, d). Stops early at `target_mse` or after
    `time_limit` seconds. `params` holds V, Q (m, d, d) as numpy arrays, `coef` the p (d, psi) of the
    learned function (comparable with mhla's fit).
    """
    from mhla_cli.model.heads import p_from_heads

    S_np, last_np = sequence_stats(tokens, offsets)
    y_np = np.asarray(targets, dtype=np.float64)
    N, d = last_np.shape
    if y_np.shape != (N, d):
        raise ValueError(f"targets must have shape ({N}, {d}), got {y_np.shape}")
    S = torch.from_numpy(np.ascontiguousarray(S_np))
    last = torch.from_numpy(np.ascontiguousarray(last_np))
    y = torch.from_numpy(np.ascontiguousarray(y_np))
    g = torch.Generator().manual_seed(seed)
    s = _init_scale(float(np.trace(S_np, axis1=1, axis2=2).mean()), d, n_heads, init_rms,
                    float(np.sqrt((last_np**2).mean() * d)))
    V = (s * torch.randn(n_heads, d, d, generator=g, dtype=torch.float64)).requires_grad_()
    Q = (s * torch.randn(n_heads, d, d, generator=g, dtype=torch.float64)).requires_grad_()

    def forward(Sb: torch.Tensor, xb: torch.Tensor) -> torch.Tensor:
        z = torch.einsum("hcl,bl->bhc", Q, xb)      # Q_h x_n
        z = torch.einsum("bjc,bhc->bhj", Sb, z)     # S Q_h x_n = X^T X Q_h x_n
        return torch.einsum("haj,bhj->ba", V, z)    # sum_h V_h (...)

    def loss_fn(idx: torch.Tensor) -> torch.Tensor:
        return ((forward(S[idx], last[idx]) - y[idx]) ** 2).mean()

    def full_mse() -> torch.Tensor:
        return ((forward(S, last) - y) ** 2).mean()

    res = _run([V, Q], loss_fn, full_mse, N, epochs, batch_size, lr, weight_decay, seed, target_mse,
               schedule, time_limit, eps, thresholds)
    Vn, Qn = V.detach().numpy().copy(), Q.detach().numpy().copy()
    res.update(params={"V": Vn, "Q": Qn}, coef=p_from_heads(Vn, Qn), model="mhla", n_heads=n_heads,
               n_samples=N, d=d, batch_size=batch_size, lr=lr, weight_decay=weight_decay, schedule=schedule)
    return res


def linear_attention_forward(layers: list[tuple[torch.Tensor, torch.Tensor]], X: torch.Tensor) -> torch.Tensor:
    """Residual single-head linear attention stack (see the module docstring); X (B, n, d) -> (B, d)."""
    Z = X
    for i, (V, Q) in enumerate(layers):
        S = Z.transpose(1, 2) @ Z                   # (B, d, d)
        if i == len(layers) - 1:
            q = Z[:, -1, :] @ Q.T                   # Q z_n
            return torch.einsum("aj,bjc,bc->ba", V, S, q)
        M = torch.einsum("aj,bjc,cl->bal", V, S, Q)  # V S Q per sequence
        Z = Z + Z @ M.transpose(1, 2)               # z_t + V S Q z_t at every position
    raise ValueError("need at least one layer")


def train_linear_attention(tokens: np.ndarray, targets: np.ndarray, n_layers: int, epochs: int,
                           batch_size: int = 64, lr: float = 1e-2, seed: int = 0,
                           target_mse: float | None = None, *, weight_decay: float = 0.0,
                           schedule: str = "constant", init_rms: float = 0.1, eps: float = 1e-8,
                           time_limit: float | None = None,
                           thresholds: tuple[float, ...] = THRESHOLDS) -> dict[str, Any]:
    """AdamW on single-head linear attention with `n_layers` residual layers; tokens (N, n, d)."""
    X_np = np.asarray(tokens, dtype=np.float64)
    if X_np.ndim != 3:
        raise ValueError("train_linear_attention needs equal-length tokens (N, n, d)")
    y_np = np.asarray(targets, dtype=np.float64)
    N, n, d = X_np.shape
    X = torch.from_numpy(np.ascontiguousarray(X_np))
    y = torch.from_numpy(np.ascontiguousarray(y_np))
    g = torch.Generator().manual_seed(seed)
    trace_s = float((X_np**2).sum(axis=(1, 2)).mean())
    last_rms = float(np.sqrt((X_np[:, -1] ** 2).mean() * d))
    s = _init_scale(trace_s, d, 1, init_rms, last_rms)
    layers = []
    for _ in range(n_layers):
        V = (s * torch.randn(d, d, generator=g, dtype=torch.float64)).requires_grad_()
        Q = (s * torch.randn(d, d, generator=g, dtype=torch.float64)).requires_grad_()
        layers.append((V, Q))

    def loss_fn(idx: torch.Tensor) -> torch.Tensor:
        return ((linear_attention_forward(layers, X[idx]) - y[idx]) ** 2).mean()

    def full_mse() -> torch.Tensor:
        return ((linear_attention_forward(layers, X) - y) ** 2).mean()

    res = _run([p for layer in layers for p in layer], loss_fn, full_mse, N, epochs, batch_size, lr,
               weight_decay, seed, target_mse, schedule, time_limit, eps, thresholds)
    res.update(params={"layers": [(V.detach().numpy().copy(), Q.detach().numpy().copy()) for V, Q in layers]},
               model="linear_attention", n_layers=n_layers, n_samples=N, d=d, batch_size=batch_size, lr=lr,
               weight_decay=weight_decay, schedule=schedule)
    return res
