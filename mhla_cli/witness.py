"""A concrete witness of non-identifiability: two models the data cannot tell apart.

Model A is the minimum-norm least-squares fit; model B = A + c u v^T, where v is a null
eigenvector of Lambda_D = gram / N (Certificate.null_vectors; for the observed domain, T^T v' with
v' null for Lambda' = T Lambda_D T^T) and u a unit vector in
output space. Because v^T gram v = sum_i (v^T H_i)^2 ~ 0, every training sample has v^T H_i ~ 0,
so B predicts what A predicts on the data (same loss), yet on a generic input X, v^T H(X) != 0 and
the predictions differ by c u v^T H(X). c is chosen so that ||p_B - p_A||_F = ||p_A||_F (the size
of the function itself), reduced if needed so that the training losses agree to 1e-10 relative.

File layout (kind "model", so `Model.load(OUT)` gives A and every model command accepts it):
  coef, W             model A (coef (d, psi), min-norm W)
  coef_b, W_b         model B
  null_direction      v (psi,);  output_direction u (d,);  attr scale = c
  witness_tokens      X (n, d), an input sequence on which A and B differ
  witness_pred_a, witness_pred_b   their last-token outputs on X (d,)
  attrs: witness = 1, loss_a, loss_b (training MSE per output), relative_loss_difference
         (|SSE_A - SSE_B| / sum ||y||^2), prediction_difference (||yhat_A(X) - yhat_B(X)||),
         relative_prediction_difference (/ ||yhat_A(X)||), null_eigenvalue, loss_source.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from . import formats
from .errors import InputError
from .features import cubic_features
from .heads import W_from_p
from .model import predict_chunk
from .solve import Certificate, Model, certify, domain_map, fit, observed_bases
from .stream import Features, default_chunk_size, spans

LOSS_TOL = 1e-10


@dataclass
class Witness:
    """Two models with the same training loss and different functions, and an input telling them apart."""

    model_a: Model
    model_b: Model
    tokens: np.ndarray
    info: dict[str, Any] = field(default_factory=dict)

    def save(self, path: str | os.PathLike, inputs: tuple[str | os.PathLike, ...] = ()) -> None:
        """Write the witness file (kind model; layout in the module docstring)."""
        d = self.model_a.d
        attrs = {"d": d, "n_features": self.model_a.coef.shape[1], "method": "lstsq", "witness": 1}
        for k in ("scale", "loss_a", "loss_b", "relative_loss_difference", "prediction_difference",
                  "relative_prediction_difference", "null_eigenvalue", "loss_source", "n_samples"):
            if self.info.get(k) is not None:
                attrs[k] = self.info[k]
        data = {"coef": self.model_a.coef, "W": self.model_a.W, "coef_b": self.model_b.coef,
                "W_b": self.model_b.W, "null_direction": self.info["null_direction"],
                "output_direction": self.info["output_direction"], "witness_tokens": self.tokens,
                "witness_pred_a": self.info["pred_a"], "witness_pred_b": self.info["pred_b"]}
        formats.write_file(path, "model", data, attrs, inputs)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Witness:
        """Read a witness file."""
        a = Model.load(path)
        with formats.open_input(path) as f:
            if "coef_b" not in f:
                raise InputError("not a witness file (no 'coef_b'); make one with mhla certify --witness", path)
            coef_b = formats.read_array(f, "coef_b", path).astype(np.float64)
            tokens = formats.read_array(f, "witness_tokens", path).astype(np.float64)
            info = {k: (v.item() if hasattr(v, "item") else v) for k, v in f.attrs.items()}
            for k in ("null_direction", "output_direction"):
                info[k] = formats.read_array(f, k, path)
            info["pred_a"] = formats.read_array(f, "witness_pred_a", path)
            info["pred_b"] = formats.read_array(f, "witness_pred_b", path)
        if coef_b.shape != a.coef.shape or tokens.ndim != 2 or tokens.shape[1] != a.d:
            raise InputError("inconsistent witness datasets", path)
        return cls(a, Model(coef=coef_b, W=W_from_p(coef_b), d=a.d), tokens, info)


def _sse_stats(feats: Features, coef: np.ndarray) -> float:
    return float(np.einsum("ij,jk,ik->", coef, feats.gram, coef) - 2 * np.einsum("ij,ji->", coef, feats.moments)
                 + np.trace(feats.target_gram))


def _sse_data(data: str | os.PathLike, coefs: list[np.ndarray], chunk_size: int | None = None
              ) -> list[float]:
    """Training SSE of several coefs in one streamed pass over a tokens file."""
    info = formats.inspect_tokens(data)
    size = chunk_size or default_chunk_size(info)
    out = [0.0] * len(coefs)
    with formats.open_input(data) as f:
        for lo, hi in spans(0, info.n_samples, size):
            tokens, offsets, targets = formats.read_tokens_span(f, info, lo, hi)
            y = np.asarray(targets, dtype=np.float64)
            for i, c in enumerate(coefs):
                pred, _ = predict_chunk(c, tokens, offsets)
                out[i] += float(((pred - y) ** 2).sum())
    return out


def make_witness(feats: Features, data: str | os.PathLike | None = None, cert: Certificate | None = None,
                 seq_len: int | None = None, seed: int = 0, chunk_size: int | None = None) -> Witness:
    """Build a witness for data that do not certify; raise InputError if they do.

    With an observed-domain certificate the two models differ on inputs of the observed domain.

    Losses are checked on the data themselves when `data` is a tokens file (one streamed pass),
    otherwise from the statistics (accurate to ~eps * sum ||y||^2).
    """
    if not feats.has_targets:
        raise InputError("--witness needs targets: the two models must have the same training loss")
    cert = certify(feats) if cert is None else cert
    if cert.identifiable:
        raise InputError("the data certify (identifiable): no two different functions fit them equally; "
                         "there is no witness")
    if cert.null_vectors is None or cert.null_vectors.shape[1] == 0:
        raise InputError(f"no null direction of gram on the {cert.domain} domain to build a witness from")
    d, N = feats.d, feats.n_samples
    model_a = fit(feats)
    pa = model_a.coef
    w = cert.eigenvalues
    null = cert.null_vectors
    v = null[:, 0]  # eigh orders eigenvalues ascending: the least excited direction
    lam_v = float(w[0])
    basis = None
    if cert.domain == "observed":
        # v' null for Lambda' = T Lambda_D T^T  =>  T^T v' is null for Lambda_D (PSD), and it changes
        # the function on inputs of the observed domain (tokens in U, last token in U_n).
        T, _, _ = domain_map(feats, "observed")
        v = T.T @ v
        v /= np.linalg.norm(v)
        basis = observed_bases(feats)
    a = int(np.argmax(np.diag(feats.target_gram)))
    u = np.zeros(d)
    u[a] = 1.0
    target_energy = float(np.trace(feats.target_gram))
    size_a = float(np.linalg.norm(pa)) or 1.0
    c = size_a

    def loss_gap(cc: float) -> float:
        pb = pa + cc * np.outer(u, v)
        return abs(_sse_stats(feats, pb) - _sse_stats(feats, pa)) / max(target_energy, 1e-300)

    while loss_gap(c) > 0.1 * LOSS_TOL and c > 1e-12 * size_a:
        c *= 0.5
    pb = pa + c * np.outer(u, v)
    model_b = Model(coef=pb, W=W_from_p(pb), d=d, info={"method": "witness"})
    # An input on which the two differ: the best of a few Gaussian sequences for |v^T H(X)| / ||X||^3.
    rng = np.random.default_rng(seed)
    n = seq_len or max(2, d + 1)
    best, best_val = None, -1.0
    for _ in range(32):
        X = rng.standard_normal((n, d))
        if basis is not None:  # an input of the observed domain
            B, C = basis
            X = np.vstack([rng.standard_normal((n - 1, B.shape[1])) @ B.T, C @ rng.standard_normal(C.shape[1])])
        val = abs(float(v @ cubic_features(X))) / float(np.linalg.norm(X)) ** 3
        if val > best_val:
            best, best_val = X, val
    X = best
    off = np.array([0, n])
    ya = predict_chunk(pa, X, off)[0][0]
    yb = predict_chunk(pb, X, off)[0][0]
    if data is not None and formats.kind_of(data) == "tokens":
        sa, sb = _sse_data(data, [pa, pb], chunk_size)
        source = "data"
    else:
        sa, sb = _sse_stats(feats, pa), _sse_stats(feats, pb)
        source = "statistics"
    rel_loss = abs(sa - sb) / max(target_energy, 1e-300)
    diff = float(np.linalg.norm(ya - yb))
    info = {"scale": c, "loss_a": max(sa, 0.0) / (N * d), "loss_b": max(sb, 0.0) / (N * d),
            "relative_loss_difference": rel_loss, "prediction_difference": diff,
            "relative_prediction_difference": diff / max(float(np.linalg.norm(ya)), 1e-300),
            "null_eigenvalue": lam_v, "loss_source": source, "n_samples": N,
            "function_distance": float(np.linalg.norm(pb - pa)),
            "relative_function_distance": float(np.linalg.norm(pb - pa)) / size_a,
            "null_direction": v, "output_direction": u, "pred_a": ya, "pred_b": yb,
            "verified": bool(rel_loss <= LOSS_TOL)}
    return Witness(model_a, model_b, X, info)
