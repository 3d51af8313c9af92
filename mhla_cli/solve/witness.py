"""A witness of what the data fail to determine: two models, their loss gap and how their functions differ.

Model A is the minimum-norm least-squares fit; model B = A + s c u v^T, where v is the direction of
the certificate's null space (Certificate.null_vectors, orthonormal columns in feature coordinates;
for the observed domain T^T of Lambda' null vectors) that gram excites least, u the output with the
largest target energy and s = +-1 the sign that makes B's training loss no lower than A's. Because
A is a least-squares optimum, the training SSE of B exceeds A's by exactly

    Delta SSE(c) = c^2 v^T gram v + 2 c |u^T (p_A gram - moments^T) v|,

so B predicts what A predicts on the data when v^T gram v ~ 0, while on an input X with
v^T H(X) != 0 the predictions differ by c |v^T H(X)|.

c is the largest value <= ||p_A||_F (a change as large as the function) whose Delta MSE stays at
float64 rounding level (<= ROUNDING x `loss_resolution`, the resolution of the training MSEs from
the statistics, lstsq.train_mse, plus the rounding of v^T gram v and of the cross term). The pair is
called **indistinguishable** when that c is >= MIN_FUNCTION_CHANGE ||p_A||_F; otherwise the data
determine the function only **weakly** (e.g. full rank but below --min-eig) and B is written at
c = ||p_A||_F, with the loss it costs. Before anything is returned the numbers are recomputed (the
losses with lstsq.train_mse and, for a tokens file, on the data; the p distance; the predictions on
the probe input from the features): a witness that disagrees with itself raises WitnessError and
is never written.

File layout (kind "model", so `Model.load(OUT)` gives A and every model command accepts it):
  coef, W             model A (coef (d, psi), min-norm W)
  coef_b, W_b         model B
  null_direction      v (psi,);  output_direction u (d,)
  witness_tokens      X (n, d), the probe input (see attr `probe`)
  witness_pred_a, witness_pred_b   their last-token outputs on X (d,)
  attrs: witness = 1, kind (indistinguishable | weakly_determined), message, scale = c,
         loss_a, loss_b (training MSE per output), loss_increase (MSE_B - MSE_A), loss_resolution,
         loss_scale (mean y^2), relative_loss_increase (= loss_increase / loss_scale),
         function_distance ||p_B - p_A||_F, relative_function_distance (/ ||p_A||_F),
         largest_indistinguishable_change (c at rounding level / ||p_A||_F), probe, prediction_difference
         ||yhat_A(X) - yhat_B(X)||, relative_prediction_difference (/ ||yhat_A(X)||), null_eigenvalue
         (v^T gram v / N), loss_source; with a tokens file also loss_increase_data,
         max_train_prediction_difference and max_train_prediction_sample.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..io import formats
from ..errors import InputError
from ..feature_map import cubic_features, features_from_moments
from ..model.heads import W_from_p, p_from_W
from ..model.model import Model
from ..model.forward import predict_chunk
from .certificate import Certificate, certify_features
from .domains import Domain, get_domain
from .lstsq import fit, train_mse
from mhla_cli.statistics.features import Features
from mhla_cli.statistics.stream import data_kind
from mhla_cli.statistics.ranges import default_chunk_size
from mhla_cli.kernels import sequence_moments
from ..io.tokens import inspect_tokens, iter_chunks, require_square
from ..numerics import EPS, W_COEF_TOL

ROUNDING = 4.0  # "at rounding level": within this many times the float64 resolution
MIN_FUNCTION_CHANGE = 1e-3  # smallest relative p distance worth calling a different function
N_PROBES = 32

_ATTRS = ("kind", "message", "scale", "loss_a", "loss_b", "loss_increase", "loss_resolution", "loss_scale",
          "relative_loss_increase", "function_distance", "relative_function_distance",
          "largest_indistinguishable_change", "probe", "prediction_difference",
          "relative_prediction_difference", "null_eigenvalue", "loss_source", "n_samples", "loss_increase_data",
          "max_train_prediction_difference", "max_train_prediction_sample")
# What `certify --witness --json` reports.
SUMMARY = ("kind", "message", "verified", "loss_a", "loss_b", "loss_increase", "loss_resolution", "loss_scale",
           "relative_loss_increase", "loss_source", "loss_increase_data", "function_distance",
           "relative_function_distance", "largest_indistinguishable_change", "probe", "prediction_difference",
           "relative_prediction_difference", "max_train_prediction_difference", "max_train_prediction_sample",
           "null_eigenvalue")


class WitnessError(RuntimeError):
    """A witness failed its own verification (an internal error): it is not returned or written."""


@dataclass
class Witness:
    """Two models, how much more training loss the second costs, and an input telling them apart."""

    model_a: Model
    model_b: Model
    tokens: np.ndarray
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def indistinguishable(self) -> bool:
        return self.info.get("kind") == "indistinguishable"

    def summary(self) -> dict[str, Any]:
        """The scalar results (what `certify --witness --json` reports)."""
        return {k: self.info[k] for k in SUMMARY if self.info.get(k) is not None}

    def save(self, path: str | os.PathLike, inputs: tuple[str | os.PathLike, ...] = ()) -> None:
        """Write the witness file (kind model; layout in the module docstring)."""
        d = self.model_a.d
        attrs = {"d": d, "n_features": self.model_a.coef.shape[1], "method": "lstsq", "witness": 1}
        for k in _ATTRS:
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
                raise InputError("not a witness file (no 'coef_b')", path)
            coef_b = formats.read_array(f, "coef_b", path).astype(np.float64)
            tokens = formats.read_array(f, "witness_tokens", path).astype(np.float64)
            info = {k: (v.item() if hasattr(v, "item") else v) for k, v in f.attrs.items()}
            for k in ("null_direction", "output_direction"):
                info[k] = formats.read_array(f, k, path)
            info["pred_a"] = formats.read_array(f, "witness_pred_a", path)
            info["pred_b"] = formats.read_array(f, "witness_pred_b", path)
            W_b = formats.read_array(f, "W_b", path).astype(np.float64) if "W_b" in f else None
        if coef_b.shape != a.coef.shape or tokens.ndim != 2 or tokens.shape[1] != a.d:
            raise InputError("inconsistent witness datasets", path)
        d, psi = a.d, a.coef.shape[1]
        shapes = {"witness_pred_a": (info["pred_a"], (d,)), "witness_pred_b": (info["pred_b"], (d,)),
                  "null_direction": (info["null_direction"], (psi,)), "output_direction": (info["output_direction"], (d,))}
        for name, (arr, shape) in shapes.items():
            if arr.shape != shape:
                raise InputError(f"'{name}' has shape {arr.shape}, expected {shape}", path)
        scale = max(float(np.abs(coef_b).max()), 1e-300)
        if W_b is not None and (W_b.shape != (d * d, d * d)
                                or not np.allclose(p_from_W(W_b), coef_b, rtol=0, atol=W_COEF_TOL * scale)):
            raise InputError("'W_b' and 'coef_b' describe different functions; the file is inconsistent", path)
        # the stored predictions must be those of the two models on the stored input
        off = np.array([0, tokens.shape[0]])
        for name, coef, pred in (("witness_pred_a", a.coef, info["pred_a"]), ("witness_pred_b", coef_b, info["pred_b"])):
            want = predict_chunk(coef, tokens, off)[0][0]
            if not np.allclose(pred, want, rtol=1e-8, atol=1e-8 * max(float(np.abs(want).max()), 1e-300)):
                raise InputError(f"'{name}' is not the prediction of its model on 'witness_tokens'; "
                                 "the file is inconsistent", path)
        return cls(a, Model(coef=coef_b, W=W_from_p(coef_b), d=d), tokens, info)


def _null_direction(feats: Features, cert: Certificate) -> np.ndarray:
    """Unit v (psi,) in the certificate's null space (in feature coordinates) minimising v^T gram v."""
    feats.expand()  # every feature (a block on the data's spans is expanded)
    null = np.asarray(cert.null_vectors, dtype=np.float64)
    psi = feats.n_features
    null = get_domain(cert.domain).to_features(feats, null)  # in the tokens' own feature coordinates
    if null.shape[0] != psi:
        raise WitnessError(f"null vectors of shape {null.shape} do not match psi = {psi}")
    Q, _ = np.linalg.qr(null)
    R = Q.T @ feats.gram @ Q
    _, a = np.linalg.eigh((R + R.T) / 2)
    v = Q @ a[:, 0]
    return v / np.linalg.norm(v)


def _probe(feats: Features, v: np.ndarray, dom: Domain, n: int, seed: int) -> tuple[np.ndarray, str]:
    """The best of N_PROBES Gaussian sequences of the domain's inputs for |v^T H(X)| / ||X||^3, and a
    description of it."""
    d = feats.d
    rng = np.random.default_rng(seed)
    basis = dom.inputs(feats)
    best: np.ndarray | None = None
    best_val = -1.0
    for _ in range(N_PROBES):
        X = rng.standard_normal((n, d))
        if basis is not None:  # an input of the domain: tokens in span B, the last token in span C
            B, C = basis
            X = np.vstack([rng.standard_normal((n - 1, B.shape[1])) @ B.T, C @ rng.standard_normal(C.shape[1])])
        val = abs(float(v @ cubic_features(X))) / max(float(np.linalg.norm(X)), 1e-300) ** 3
        if val > best_val:
            best, best_val = X, val
    assert best is not None  # N_PROBES > 0 probes, each of a value >= 0
    where = dom.probe_description()
    desc = (f"the one of {N_PROBES} random sequences of length {n} ({where}; numpy default_rng({seed})) with "
            f"the largest |v^T H(X)| / ||X||^3, stored as witness_tokens")
    return best, desc


def _gamma(feats: Features) -> float:
    """Relative rounding of an accumulated float64 sum of products (N terms, dot products of psi)."""
    return 8 * (feats.n_features + float(np.sqrt(max(feats.n_samples, 1)))) * EPS


def _stats_terms(feats: Features, pa: np.ndarray, v: np.ndarray, u: np.ndarray) -> dict[str, float]:
    """g = v^T gram v, b = u^T (p_A gram - moments^T) v and their rounding bounds, from the statistics.

    An accumulated entry gram[k, l] = sum_i H_ik H_il is off by at most ~gamma sum_i |H_ik| |H_il|
    <= gamma s_k s_l (s = sqrt(diag gram)), so v^T gram v is known to gamma (|v|.s)^2 (invariant
    under rescaling single features), and the cross term likewise.
    """
    feats.expand()  # every feature (a block on the data's spans is expanded)
    G, M = feats.gram, feats.moments
    assert G is not None and M is not None and feats.target_gram is not None  # checked by `witness`
    gamma = _gamma(feats)
    s = np.sqrt(np.maximum(np.diag(G), 0.0))
    vs = float(np.abs(v) @ s)
    ys = float(np.abs(u) @ np.sqrt(np.maximum(np.diag(feats.target_gram), 0.0)))
    ps = float(np.abs(u @ pa) @ s)
    return {"g": float(v @ G @ v), "b": float(u @ (pa @ (G @ v) - M.T @ v)),
            "g_round": gamma * vs * vs, "b_round": gamma * vs * (ps + ys)}


def _data_terms(data: str | os.PathLike, pa: np.ndarray, v: np.ndarray, u: np.ndarray,
                chunk_size: int | None) -> dict[str, float]:
    """The same g and b summed on the data (t_i = v^T H_i, r_i = p_A H_i - y_i; no Gram, so no squared
    condition number), with bounds on their rounding, and max_i |t_i| (sample index)."""
    info = inspect_tokens(data)
    require_square(info, "the witness")
    size = chunk_size or default_chunk_size(info)
    psi = pa.shape[1]
    e = 4 * psi * EPS
    pu = u @ pa
    g = b = g_round = b_round = 0.0
    best, best_i = -1.0, -1
    for lo, hi, tokens, offsets, targets in iter_chunks(info, (0, info.n_samples), size):
        yu = np.asarray(targets, dtype=np.float64) @ u
        S, last = sequence_moments(tokens, offsets)
        H = features_from_moments(S, last)
        t = H @ v
        r = H @ pu - yu
        tau = e * (np.abs(H) @ np.abs(v))  # rounding of t_i
        rho = e * (np.abs(H) @ np.abs(pu) + np.abs(yu))  # rounding of r_i
        g += float(t @ t)
        b += float(t @ r)
        g_round += float((2 * np.abs(t) * tau + tau * tau).sum() + e * (t @ t))
        b_round += float((tau * np.abs(r) + np.abs(t) * rho + tau * rho).sum() + e * abs(float(t @ r)))
        if t.size:
            i = int(np.argmax(np.abs(t)))
            if abs(t[i]) > best:
                best, best_i = float(abs(t[i])), lo + i
    return {"g": g, "b": b, "g_round": g_round, "b_round": b_round, "max_t": best, "max_sample": best_i}


def _data_check(data: str | os.PathLike, pa: np.ndarray, pb: np.ndarray, chunk_size: int | None
                ) -> dict[str, float]:
    """Recompute on the data with the two models' predictions: SSE_A, SSE_B - SSE_A in product form
    (sum (yhat_B - yhat_A) . (yhat_B + yhat_A - 2 y)), a bound on its rounding, max ||yhat_B - yhat_A||."""
    info = inspect_tokens(data)
    require_square(info, "the witness")
    size = chunk_size or default_chunk_size(info)
    e = 4 * pa.shape[1] * EPS
    sse_a = dsse = bound = 0.0
    best = best_round = -1.0
    for lo, hi, tokens, offsets, targets in iter_chunks(info, (0, info.n_samples), size):
        y = np.asarray(targets, dtype=np.float64)
        ya, _ = predict_chunk(pa, tokens, offsets)
        yb, _ = predict_chunk(pb, tokens, offsets)
        S, last = sequence_moments(tokens, offsets)
        Ha = np.abs(features_from_moments(S, last))
        diff, total = yb - ya, yb + ya - 2 * y
        sse_a += float(((ya - y) ** 2).sum())
        dsse += float((diff * total).sum())
        delta = e * (Ha @ (np.abs(pa) + np.abs(pb)).T)  # rounding of yhat_A + rounding of yhat_B
        bound += float((delta * (np.abs(total) + np.abs(diff) + 2 * delta)).sum()
                       + e * float(np.abs(diff * total).sum()))
        nd = np.linalg.norm(diff, axis=1)
        if nd.size:
            best = max(best, float(nd.max()))
            best_round = max(best_round, float(np.linalg.norm(delta, axis=1).max()))
    return {"sse_a": sse_a, "dsse": dsse, "bound": bound, "max_diff": best, "max_round": best_round}


class WitnessRefused(InputError):
    """Data the witness does not support (its preconditions); `rule` names the one broken:
    "per_position" (per-position data), "targets" (no targets), "normalized" (--normalize / causal data) or
    "bias_terms" (statistics with the bias terms)."""

    def __init__(self, rule: str, message: str, path: str | os.PathLike | None = None) -> None:
        self.rule = rule
        super().__init__(message, None if path is None else str(path))


def check_witness_input(data: str | os.PathLike) -> None:
    """Refuse, before any work, a tokens file the witness does not support (WitnessRefused); other files pass."""
    if data_kind(data) != "tokens":
        return
    info = inspect_tokens(data)
    if info.per_position:
        raise WitnessRefused("per_position", "a witness supports last-token data only (this file has "
                             "per-position data)", data)
    if not info.has_targets:
        raise WitnessRefused("targets", "a witness needs targets: the two models are compared by their "
                             "training loss", data)


def check_witness_features(feats: Features, path: str | os.PathLike | None = None) -> None:
    """Refuse statistics the witness does not support: per-position or normalised ones (WitnessRefused)."""
    if feats.per_position or feats.normalize != "none":
        raise WitnessRefused("normalized", "a witness supports unweighted last-token data without normalize "
                             "only", path)
    if feats.bias_terms:  # its probe input would be tokens of d + 1 free coordinates, not (x, 1)
        raise WitnessRefused("bias_terms", "a witness supports the MHLA's features only, not the bias terms", path)


def make_witness(feats: Features, data: str | os.PathLike | None = None, cert: Certificate | None = None,
                 seq_len: int | None = None, seed: int = 0, chunk_size: int | None = None,
                 device: str | None = None, domain: str | Domain = "full") -> Witness:
    """Build and verify a witness for data that do not certify; raise InputError if they do.

    `cert`: the certificate to build on (None: certify on `domain`, a name or a
    mhla_cli.solve.domains.Domain); with a certificate of a restricted domain (e.g. observed) the two
    models differ on inputs of that domain. `info["kind"]` is "indistinguishable" (training-loss gap
    at float64 rounding level, functions >= MIN_FUNCTION_CHANGE apart) or "weakly_determined" (a
    change of the function costs a measurable training loss; `message` gives the numbers). The loss
    terms are summed on the data when `data` is a tokens file, otherwise taken from the statistics.
    `device`: where a factorization still to compute runs (None: the certificate's). `feats` is not
    changed (statistics on the data's spans are expanded in a copy). Raises WitnessRefused (an InputError
    with its `rule`) for data the witness does not support (per-position, untargeted or normalised data,
    statistics with the bias terms) and WitnessError when it fails its own verification.
    """
    device = cert.device if device is None and cert is not None else device
    feats, cert = _prepare(feats, data, cert, device, domain)
    d, W = feats.d, (feats.weight if feats.weight > 0 else 1.0)  # sum w: the MSE's normaliser (lstsq.train_mse)
    assert feats.target_gram is not None  # checked by `witness`
    Nd = W * d
    model_a = fit(feats, device=device)
    pa = model_a.coef
    v = _null_direction(feats, cert)
    u = np.zeros(d)
    u[int(np.argmax(np.diag(feats.target_gram)))] = 1.0
    norm_a = float(np.linalg.norm(pa))
    ref = norm_a if norm_a > 0 else 1.0
    mse_a, res_a = train_mse(feats, pa)
    st = _stats_terms(feats, pa, v, u)
    tokens_file = data is not None and data_kind(data) == "tokens"
    terms = _data_terms(data, pa, v, u, chunk_size) if data is not None and tokens_file else st
    gap = _Gap(terms, res_a, Nd)
    c_round = gap.largest_at_rounding(ref)
    indistinguishable = c_round >= MIN_FUNCTION_CHANGE * ref
    c = c_round if indistinguishable else ref
    sign = -1.0 if terms["b"] < 0 else 1.0  # B's loss is no lower than A's
    pb = pa + sign * c * np.outer(u, v)
    mse_b, res_b = train_mse(feats, pb)
    claimed, res = gap.increase(c), gap.rounding(c) + res_b
    problems: list[str] = []
    dist = _stats_check(pa, pb, c, claimed, res, (mse_a, res_a, mse_b, res_b), st, Nd, problems)
    X, probe = _probe(feats, v, get_domain(cert.domain), seq_len or max(2, d + 1), seed)
    pred = _probe_check(pa, pb, X, c * abs(float(v @ cubic_features(X))), problems)
    extra = (_data_recheck(data, pa, pb, chunk_size, c, claimed, res, terms, Nd, problems)
             if data is not None and tokens_file else {})
    y2 = float(np.trace(feats.target_gram)) / Nd
    loss_scale = y2 if y2 > 0 else max(mse_b, res)
    info: dict[str, Any] = {
        "scale": c, "loss_a": mse_a, "loss_b": mse_b, "loss_increase": claimed, "loss_resolution": res,
        "loss_scale": loss_scale, "relative_loss_increase": claimed / loss_scale, "function_distance": dist,
        "relative_function_distance": dist / ref, "largest_indistinguishable_change": c_round / ref,
        "probe": probe, **pred, "null_eigenvalue": terms["g"] / W,
        "loss_source": "data" if tokens_file else "statistics", "n_samples": feats.n_samples, **extra,
        "null_direction": v, "output_direction": u,
    }
    numbers = [x for x in info.values() if isinstance(x, float)]
    if not (np.isfinite(numbers).all() and np.isfinite(pb).all() and np.isfinite(info["pred_b"]).all()):
        problems.append("a witness number is not finite")
    if problems:
        raise WitnessError("the witness failed its own verification and is not written: " + "; ".join(problems))
    _describe(info, indistinguishable, tokens_file)
    return Witness(model_a, Model(coef=pb, W=W_from_p(pb), d=d, info={"method": "witness"}), X, info)


def _prepare(feats: Features, data: str | os.PathLike | None, cert: Certificate | None, device: str | None,
             domain: str | Domain) -> tuple[Features, Certificate]:
    """The witness's preconditions; (statistics with every feature, their certificate)."""
    check_witness_features(feats)
    if data is not None:
        check_witness_input(data)
    if feats.on_spans:
        # every feature is needed: the sums on the data's spans expanded in a copy (the caller's stay
        # as they are), and the same certificate of the expanded sums
        feats = feats.copy().expand()
        if cert is not None:
            cert = certify_features(feats, min_eig=cert.min_eig, domain=cert.domain, device=device)
    feats.expand()
    if not feats.has_targets:
        raise WitnessRefused("targets", "a witness needs targets: the two models are compared by their training loss")
    cert = certify_features(feats, domain=domain, device=device) if cert is None else cert
    if cert.identifiable:
        raise InputError("the data certify (identifiable): no two different functions fit them equally; "
                         "there is no witness")
    if cert.null_vectors is None or cert.null_vectors.shape[1] == 0:
        raise InputError(f"no null direction of gram on the {cert.domain} domain to build a witness from")
    if not all(x is not None and np.isfinite(x).all() for x in (feats.gram, feats.moments, feats.target_gram)):
        raise InputError("the statistics are not finite (values too large for float64): no witness")
    return feats, cert


class _Gap:
    """MSE_B - MSE_A at scale c (exact in exact arithmetic) and its float64 resolution, from the loss terms."""

    def __init__(self, terms: dict[str, float], res_a: float, Nd: float) -> None:
        self.t, self.res_a, self.Nd = terms, res_a, Nd

    def increase(self, c: float) -> float:
        return (max(self.t["g"], 0.0) * c * c + 2 * abs(self.t["b"]) * c) / self.Nd

    def rounding(self, c: float) -> float:  # resolution of MSE_A and of the increase
        return self.res_a + (self.t["g_round"] * c * c + 2 * self.t["b_round"] * c) / self.Nd

    def largest_at_rounding(self, ref: float) -> float:
        """The largest c <= ref at rounding level. f(c) = increase - ROUNDING * rounding is a quadratic
        with f(0) < 0, so when f(ref) > 0 it has exactly one root in (0, ref): bisection."""
        if self.increase(ref) <= ROUNDING * self.rounding(ref):
            return ref
        lo, hi = 0.0, ref
        while hi - lo > 1e-6 * hi:
            mid = 0.5 * (lo + hi)
            lo, hi = (mid, hi) if self.increase(mid) <= ROUNDING * self.rounding(mid) else (lo, mid)
        return lo


def _stats_check(pa: np.ndarray, pb: np.ndarray, c: float, claimed: float, res: float,
                 mses: tuple[float, float, float, float], st: dict[str, float], Nd: float, problems: list[str]
                 ) -> float:
    """(i) the loss increase from the statistics (lstsq.train_mse), to their own resolution, and (ii) the
    distance between the two functions (returned)."""
    mse_a, res_a, mse_b, res_b = mses
    res_stats = res_a + res_b + (st["g_round"] * c * c + 2 * st["b_round"] * c) / Nd
    if abs((mse_b - mse_a) - claimed) > ROUNDING * (res_stats + res):
        problems.append(f"training MSE increase {mse_b - mse_a:.3g} from the statistics, claimed {claimed:.3g} "
                        f"(resolution {res_stats:.3g})")
    dist = float(np.linalg.norm(pb - pa))
    if abs(dist - c) > 1e-12 * c:
        problems.append(f"||p_B - p_A|| = {dist:.17g}, claimed {c:.17g}")
    return dist


def _probe_check(pa: np.ndarray, pb: np.ndarray, X: np.ndarray, expect: float, problems: list[str]
                 ) -> dict[str, Any]:
    """(iii) the predictions on the probe input, against c |v^T H(X)| (`expect`) from the features."""
    off = np.array([0, X.shape[0]])
    ya = predict_chunk(pa, X, off)[0][0]
    yb = predict_chunk(pb, X, off)[0][0]
    pdiff = float(np.linalg.norm(ya - yb))
    if abs(pdiff - expect) > 1e-8 * (float(np.linalg.norm(ya)) + float(np.linalg.norm(yb)) + expect):
        problems.append(f"prediction difference on the probe {pdiff:.6g}, expected c |v^T H(X)| = {expect:.6g}")
    return {"prediction_difference": pdiff,
            "relative_prediction_difference": pdiff / max(float(np.linalg.norm(ya)), 1e-300),
            "pred_a": ya, "pred_b": yb}


def _data_recheck(data: str | os.PathLike, pa: np.ndarray, pb: np.ndarray, chunk_size: int | None, c: float,
                  claimed: float, res: float, terms: dict[str, float], Nd: float, problems: list[str]
                  ) -> dict[str, Any]:
    """(iv) on the data, with the two models' own predictions."""
    chk = _data_check(data, pa, pb, chunk_size)
    if abs(chk["dsse"] / Nd - claimed) > ROUNDING * (res + chk["bound"] / Nd):
        problems.append(f"training MSE increase recomputed on the data {chk['dsse'] / Nd:.3g}, claimed "
                        f"{claimed:.3g} (resolution {res:.3g} + {chk['bound'] / Nd:.3g})")
    if abs(chk["max_diff"] - c * terms["max_t"]) > 1e-8 * chk["max_diff"] + ROUNDING * chk["max_round"]:
        problems.append(f"largest prediction difference on the data {chk['max_diff']:.6g}, expected "
                        f"{c * terms['max_t']:.6g}")
    return {"loss_increase_data": chk["dsse"] / Nd, "max_train_prediction_difference": chk["max_diff"],
            "max_train_prediction_sample": int(terms["max_sample"])}


def _describe(info: dict[str, Any], indistinguishable: bool, tokens_file: bool) -> None:
    """info's kind, message and verified (in place)."""
    where = f"on the probe input by {info['prediction_difference']:.4g} ({info['relative_prediction_difference']:.3g} relative)"
    if tokens_file:
        where += (f", on training sample {info['max_train_prediction_sample']} by "
                  f"{info['max_train_prediction_difference']:.3g}")
    rel_fn, claimed, res = info["relative_function_distance"], info["loss_increase"], info["loss_resolution"]
    if indistinguishable:
        info["kind"] = "indistinguishable"
        info["message"] = (f"the data cannot tell apart two functions whose p differ by {rel_fn:.3g} x ||p_A|| "
                           f"(relative p distance): their training MSEs differ by {claimed:.3g}, at float64 "
                           f"rounding level (resolution {res:.3g}); their predictions differ {where}")
    else:
        info["kind"] = "weakly_determined"
        info["message"] = (f"the data determine the function only weakly: changing p by {rel_fn:.3g} x ||p_A|| "
                           f"(relative p distance) costs {claimed:.3g} in training MSE "
                           f"({info['relative_loss_increase']:.3g} of the mean y^2; resolution {res:.3g}); at "
                           f"rounding level p moves only {info['largest_indistinguishable_change']:.3g} x ||p_A||, "
                           f"below the {MIN_FUNCTION_CHANGE:g} needed to call two functions different; the "
                           f"predictions differ {where}")
    info["verified"] = True
