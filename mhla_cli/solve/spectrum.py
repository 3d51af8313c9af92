"""Spectrum of a learned function: head strengths, real heads vs a noise bulk.

The spectrum is that of the minimum-nuclear-norm W among all W with the model's p (lowrank.min_nuclear_W),
not of the minimum-norm W, whose (j, k) symmetrisation mixes the heads and leaves no gap. It is taken
in the canonical coordinates of the model's data (the whitened tokens, mhla_cli.model.canonical), where
a change of the tokens' units moves W by an orthogonal map: the values and the count are unit-free.

Threshold. The nuclear minimisation makes W exactly low rank: noise directions are not a full
bulk but a set of small NONZERO values next to exact zeros. So:
- "nonzero" means s > 1e-8 s_max (well above the 1e-11 convergence of min_nuclear_W);
- if the nonzero count r is below the generic rank r_gen(d) = min{r : r (2 d^2 - r) >= d psi}, p is
  exactly low rank (no noise: a generic p cannot be reached by a W of rank < r_gen, since the
  rank-r matrices form a variety of dimension r (2 d^2 - r) < d psi), and every nonzero value is a head;
- otherwise the Gavish-Donoho hard threshold for unknown noise, tau = omega(1) * median, with
  omega(1) = 2.858 for a square matrix (Gavish & Donoho 2014), where the median is that of the
  NONZERO values: the exact zeros are an artefact of the minimisation, not noise, and including them
  drags the median (and tau) down until part of the bulk counts as heads.
A noise level propagated from the fit's residual through gram^-1 would need the statistics, which a
model file does not carry; this rule needs only the function.

Reliability. The split rests on the exact zeros and the bulk of a converged W. Stopped at its
iteration limit, the solver leaves values that should be zero in the bulk and the median-based
threshold then cuts through it (a 2-head teacher at d = 6, noise 0.01, length-10 sequences: 9
"heads" after 5000 iterations, 2 once converged after ~24000). An unconverged W's count is kept only
when its outliers stand apart from the rest, s_k / s_(k+1) >= RELIABLE_GAP (there the count cannot
move with the bulk); otherwise there is no reliable count: `n_outliers` is None and `reason` says why
(`mhla spectrum` and `export-heads --max-heads auto` exit 1).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .._version import __version__
from ..io import formats
from ..errors import InputError, MhlaError
from ..model.canonical import CanonicalFunction, canonical_function
from ..model.heads import Heads, p_from_W
from .lowrank import generic_rank, min_nuclear_W, polish_heads
from ..model.model import Model

from ..numerics import NONZERO_REL  # noqa: E402  (a singular value is nonzero above NONZERO_REL s_max)
OMEGA_SQUARE = 2.858  # Gavish-Donoho omega(beta) at beta = 1 (unknown noise level)
# An unconverged W's head count is trusted when its k outliers stand RELIABLE_GAP (mhla_cli.numerics)
# above the rest: s_k / s_(k+1) >= RELIABLE_GAP.
from ..numerics import RELIABLE_GAP  # noqa: E402


class UnreliableHeadCount(MhlaError):
    """No head count is reliable: the minimum-nuclear-norm W did not converge and its outliers do not stand
    apart from the rest (`spectrum`'s reason)."""


def outlier_gap(s: np.ndarray, k: int) -> float:
    """s_k / s_(k+1) for the k largest of the descending values s: inf when nothing follows them (or a zero
    does), 0 for k = 0."""
    s = np.asarray(s, dtype=np.float64)
    if k <= 0:
        return 0.0
    if k >= s.size or s[k] <= 0:
        return float("inf")
    return float(s[k - 1] / s[k])


def count_reliability(s: np.ndarray, k: int, converged: bool | None) -> tuple[bool, str | None]:
    """Whether the count k of outliers of the singular values s can be trusted, and if not why: always from
    a converged (or given, converged None) W; from an unconverged one when s_k / s_(k+1) >= RELIABLE_GAP."""
    if converged is not False:
        return True, None
    gap = outlier_gap(s, k)
    if gap >= RELIABLE_GAP:
        return True, None
    return False, (f"the minimum-nuclear-norm W did not converge, and the {k} value(s) above the threshold do not "
                   f"stand apart from the rest (s_{k} / s_{k + 1} = {gap:.3g} < {RELIABLE_GAP:g}): no head count is "
                   "reliable (`mhla spectrum MODEL` with a larger iteration limit shows whether more iterations give one)")


def effective_rank(s: np.ndarray) -> float:
    """Entropy effective rank exp(-sum q log q), q = s / sum s (Roy & Vetterli 2007)."""
    s = np.asarray(s, dtype=np.float64)
    tot = float(s.sum())
    if tot <= 0:
        return 0.0
    q = s[s > 0] / tot
    return float(np.exp(-(q * np.log(q)).sum()))


@dataclass
class Spectrum:
    """The singular values of a function's minimum-nuclear-norm W in the canonical coordinates and their split
    into heads and noise (`spectrum`); `to_dict` is the `mhla spectrum --json` record, without W.

    `n_outliers`: the heads that stand out of the noise above `threshold` (None when the count is not
    reliable, e.g. an unconverged W: `reason`); `singular_values`; `W`."""

    d: int
    singular_values: list[float]
    n_outliers: int | None  # None: no reliable count (`reason` says why)
    threshold: float
    effective_rank: float
    nonzero_rank: int
    generic_rank: int
    threshold_method: str
    function_change: float | None  # of p(W) against the function (None: no Lambda~ of the data)
    coef_change: float
    coordinates: str  # "canonical" or "own" (mhla_cli.model.canonical)
    count_reliable: bool
    gap: float
    reason: str | None
    converged: bool | None  # whether min_nuclear_W met its tolerance (None for a given W)
    solver: dict[str, Any] | None
    W: np.ndarray = field(repr=False)  # in the coordinates `coordinates` (times the function's scale)

    def __repr__(self) -> str:  # the count and its threshold, not the values
        return (f"Spectrum(d={self.d}, n_outliers={self.n_outliers}, threshold={self.threshold:.4g}, "
                f"threshold_method={self.threshold_method!r}, nonzero_rank={self.nonzero_rank}/"
                f"{len(self.singular_values)}, coordinates={self.coordinates!r}, converged={self.converged})")

    def to_dict(self) -> dict[str, Any]:
        return {"d": self.d, "singular_values": list(self.singular_values), "n_outliers": self.n_outliers,
                "threshold": self.threshold, "effective_rank": self.effective_rank, "nonzero_rank": self.nonzero_rank,
                "generic_rank": self.generic_rank, "threshold_method": self.threshold_method,
                "function_change": self.function_change, "coef_change": self.coef_change,
                "coordinates": self.coordinates, "count_reliable": self.count_reliable,
                "gap": self.gap, "reason": self.reason, "converged": self.converged, "solver": self.solver}


def _scaled(fn: Model | Heads | np.ndarray | CanonicalFunction) -> CanonicalFunction:
    return fn if isinstance(fn, CanonicalFunction) else canonical_function(fn)


def spectrum(fn: Model | Heads | np.ndarray | CanonicalFunction, W: np.ndarray | None = None,
             max_iter: int = 5000, tol: float = 1e-11) -> Spectrum:
    """Singular values of the min-nuclear-norm W of fn's function and their split into heads and noise.

    W is that of the function in the canonical coordinates of its data (mhla_cli.model.canonical: a model
    with its canonical basis; the tokens' own coordinates otherwise), so that the values and the count do
    not depend on the units of the tokens. A given `W` is in those coordinates.
    `converged` / `solver` say whether min_nuclear_W met its tolerance within max_iter; when it did not,
    the zeros of the spectrum (and so the head count) are not to be trusted. With a given W, both are None.
    """
    cf = _scaled(fn)
    coef = cf.coef
    d = coef.shape[0]
    if W is None:
        Wn, solver = min_nuclear_W(coef, tol=tol, max_iter=max_iter, return_info=True)
    else:
        Wn, solver = np.asarray(W, dtype=np.float64) / cf.scale, None
    s = np.linalg.svd(Wn, compute_uv=False)
    smax = float(s[0]) if s.size else 0.0
    nz = s[s > NONZERO_REL * smax] if smax > 0 else s[:0]
    r = int(nz.size)
    r_gen = generic_rank(d)
    if r == 0:
        method, tau = "zero", 0.0
    elif r < r_gen:
        method, tau = "exact-low-rank", NONZERO_REL * smax
    else:
        method, tau = "gavish-donoho-nonzero-median", OMEGA_SQUARE * float(np.median(nz))
    n_out = int((s > tau).sum()) if smax > 0 else 0
    converged = None if solver is None else bool(solver["converged"])
    reliable, reason = count_reliability(s, n_out, converged)
    rec = cf.record(p_from_W(Wn))
    return Spectrum(d=d, singular_values=(s * cf.scale).tolist(), n_outliers=n_out if reliable else None,
                    threshold=tau * cf.scale, effective_rank=effective_rank(s), nonzero_rank=r, generic_rank=r_gen,
                    threshold_method=method, function_change=rec["function_change"], coef_change=rec["coef_change"],
                    coordinates=rec["coordinates"], count_reliable=reliable, gap=outlier_gap(s, n_out), reason=reason,
                    converged=converged, solver=solver, W=Wn * cf.scale)


def outlier_heads(fn: Model | Heads | np.ndarray | CanonicalFunction, spec: Spectrum | None = None,
                  max_iter: int = 5000) -> Heads:
    """Heads for the spectrum's outliers: top-k SVD of the min-nuclear W, polished towards the function, in
    the canonical coordinates, then mapped to the tokens' (CanonicalFunction.heads).

    The dropped bulk changes the function: info holds its change (function_change on the training data,
    coef_change, coordinates: CanonicalFunction.record), and `converged` / `solver` of the min-nuclear W
    the count k came from. UnreliableHeadCount when the spectrum has no reliable count (module docstring).
    """
    cf = _scaled(fn)
    coef = cf.coef
    spec = spectrum(cf, max_iter=max_iter) if spec is None else spec
    if spec.n_outliers is None:
        raise UnreliableHeadCount(spec.reason)
    k = max(1, int(spec.n_outliers))
    U, s, Vt = np.linalg.svd(spec.W / cf.scale)
    r = np.sqrt(s[:k])
    V0 = (U[:, :k] * r).T
    Q0 = (Vt[:k].T * r).T

    def change(V: np.ndarray, Q: np.ndarray) -> float:
        return cf.change(p_from_W(V.T @ Q))

    V1, Q1, _ = polish_heads(coef, V0, Q0, max_iter=50, metric=cf.metric)  # towards the function on the data
    if change(V1, Q1) < change(V0, Q0):
        V0, Q0 = V1, Q1
    heads = cf.heads(V0, Q0)
    heads.info = {"n_heads": k, **cf.record(p_from_W(V0.T @ Q0)), "max_heads": k,
                  "singular_values": spec.singular_values, "threshold": spec.threshold,
                  "threshold_method": spec.threshold_method, "converged": spec.converged,
                  "gap": spec.gap, "solver": spec.solver}
    return heads


def text_histogram(spec: Spectrum, width: int = 40) -> str:
    """Outliers as bars (linear in s / s_max), then a per-decade histogram of the other nonzero values."""
    s = np.asarray(spec.singular_values)
    tau = spec.threshold
    lines = []
    smax = float(s[0]) if s.size and s[0] > 0 else 1.0
    out = s[s > tau]
    label = "head" if spec.count_reliable else "  s_"  # no reliable count: values, not heads
    for i, v in enumerate(out):
        bar = "#" * max(1, int(round(width * v / smax)))
        lines.append(f"  {label} {i + 1:3d}  {v:10.4g}  {bar}")
    lines.append(f"  ---- threshold {tau:.4g} ({spec.threshold_method}) ----")
    rest = s[(s <= tau) & (s > NONZERO_REL * smax)]
    if rest.size:
        lo = int(np.floor(np.log10(rest.min())))
        hi = int(np.floor(np.log10(rest.max())))
        counts = [(e, int(((rest >= 10.0**e) & (rest < 10.0 ** (e + 1))).sum())) for e in range(hi, lo - 1, -1)]
        top = max(c for _, c in counts) or 1
        for e, c in counts:
            lines.append(f"  [1e{e:+d}, 1e{e + 1:+d})  {c:4d}  {'*' * max(0, int(round(width * c / top)))}")
    zeros = int((s <= NONZERO_REL * smax).sum())
    lines.append(f"  {zeros} value(s) <= {NONZERO_REL:g} s_max (zero)")
    return "\n".join(lines)


def pyplot() -> Any:
    """matplotlib.pyplot on the Agg backend; InputError (naming the `plot` extra) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise InputError("plotting needs matplotlib: pip install 'matplotlib>=3.6' (mhla's [plot] extra)") from None
    return plt


def plot_spectrum(spec: Spectrum, path: str | os.PathLike) -> None:
    """Write a PNG of the singular values (log scale) with the threshold; needs the `plot` extra."""
    plt = pyplot()
    s = np.asarray(spec.singular_values)
    floor = max(float(s[0]) * 1e-17, 1e-300) if s.size else 1e-300
    fig, ax = plt.subplots(figsize=(6, 3.5))
    idx = np.arange(1, s.size + 1)
    heads = s > spec.threshold
    ax.semilogy(idx[heads], np.maximum(s[heads], floor), "o", color="C3", label="heads (outliers)")
    ax.semilogy(idx[~heads], np.maximum(s[~heads], floor), ".", color="C0", label="bulk / zero")
    if spec.threshold > 0:
        ax.axhline(spec.threshold, color="gray", ls="--", label=f"threshold ({spec.threshold_method})")
    ax.set_xlabel("index")
    ax.set_ylabel("singular value of min-nuclear-norm W")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = formats.check_output_path(path, kind="plot")
    with formats.atomic_path(out) as tmp:
        fig.savefig(tmp, format="png", dpi=120, metadata={"Software": f"{formats.PNG_SOFTWARE} {__version__}"})
    plt.close(fig)
