"""The record every iterative solver returns, and the warning texts the CLI prints from it."""

from __future__ import annotations

from typing import Any


def solver_info(name: str, converged: bool, iterations: int, max_iter: int, final_residual: float,
                residual: str, tol: float, **extra: Any) -> dict[str, Any]:
    """The record every iterative solver returns: did it stop on its criterion or at its limit."""
    return {"solver": name, "converged": bool(converged), "iterations": int(iterations), "max_iter": int(max_iter),
            "final_residual": float(final_residual), "residual": residual, "tol": float(tol), **extra}


def hit_limit(info: dict[str, Any] | None) -> bool:
    """True when an iterative solver's record says it stopped at its iteration limit, unconverged."""
    return info is not None and bool(info) and not info.get("converged", True) and info.get("iterations", 0) >= info.get("max_iter", 0)


def solver_warnings(info: dict[str, Any]) -> list[str]:
    """Warnings for a fit/heads info dict: its solver record, and CV fits that stopped at their limit."""
    out = []
    solver = info.get("solver")
    if solver is not None and hit_limit(solver):
        out.append(convergence_warning(solver))
    cv = info.get("cv") or {}
    if cv.get("unconverged_fits"):
        out.append(f"{cv['unconverged_fits']} of {cv['fits']} cross-validation fits stopped at their iteration "
                   "limit before converging: the CV choice is from unconverged fits")
    return out


def convergence_warning(info: dict[str, Any], what: str | None = None) -> str:
    """The stderr warning text for an unconverged solver record."""
    return (f"{what or info['solver']} did not converge after {info['iterations']} iterations "
            f"(residual {info['final_residual']:.3g}, tolerance {info['tol']:.3g})")
