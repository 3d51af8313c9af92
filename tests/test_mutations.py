"""The boundary tests see every cut: each mutation below, applied alone to a copy of the package, makes
at least one of them fail (tests/test_numerics.py's `test_cut_*` and test_factorization's spectral
ridge), run as the code review that listed S1-S11 ran them (code-review-96474f1); and every check of
export-heads, spectrum and compare made in the tokens' own coordinates fails tests/test_canonical.py or
test_compare.py (`OWN_COORDINATES`, issue 36).

The mutations: the review's S1-S11 adapted to the current code, the ridge's own rule, and a x1e4 and a
x1e-4 change of each named constant of mhla_cli.numerics (EPS included). A cross-cutting test (like
test_metamorphic): slow, one pytest run per mutation (`python -m pytest -m slow tests/test_mutations.py`).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# (name, file, old, new): `old` occurs exactly once in `file`
REVIEW = [
    ("S1 structure cut x1e6", "mhla_cli/statistics/structure.py", "cut = STRUCTURE_FACTOR * psi * EPS * max(",
     "cut = 1e6 * STRUCTURE_FACTOR * psi * EPS * max("),
    ("S2 change_basis keeps basis_last_token_gram", "mhla_cli/statistics/algebra.py",
     "        self.basis_last_token_gram = C.T @ self.basis_last_token_gram @ C\n", ""),
    ("S3 LANCZOS_TOL 1e-1", "mhla_cli/numerics.py", "LANCZOS_TOL = 1e-7", "LANCZOS_TOL = 1e-1"),
    ("S4 DETERMINED_TOL 1e-4", "mhla_cli/numerics.py", "DETERMINED_TOL = 1e-8", "DETERMINED_TOL = 1e-4"),
    ("S5 null_weight without its P_Z term", "mhla_cli/solve/certificate.py", '        weight += np.einsum("ij,ij->i", Z, Z)\n',
     "        pass\n"),
    ("S6 observed-span rule 1e-6", "mhla_cli/numerics.py",
     "max(OBSERVED_SPAN_FACTOR * d * EPS * math.sqrt(max(count, 1)), d * eps_in**2)", "1e-6"),
    ("S7 MSE resolution x1e6", "mhla_cli/numerics.py", "return MSE_RESOLUTION_FACTOR * n_features",
     "return 1e6 * MSE_RESOLUTION_FACTOR * n_features"),
    ("S8 numerical tolerance x1e4", "mhla_cli/numerics.py", "return RANK_FACTOR * n * EPS * max(lambda_max, 0.0)",
     "return 1e4 * RANK_FACTOR * n * EPS * max(lambda_max, 0.0)"),
    ("S9 certify's tolerance with the block's n", "mhla_cli/solve/certificate.py", "tol = numerical_tolerance(lmax, m)",
     "tol = numerical_tolerance(lmax, fac.n)"),
    ("S10 train MSE without tr(target_gram)", "mhla_cli/solve/lstsq.py",
     'sse = quad - 2 * float(np.einsum("ij,ji->", pb, moments_b)) + float(np.trace(feats.target_gram))',
     'sse = quad - 2 * float(np.einsum("ij,ji->", pb, moments_b))'),
    ("S11 ridge in the wrong units", "mhla_cli/linalg/factorization.py",
     "x = self._matrix().shifted_solve(self.scale, ridge, rhs)",
     "x = self._matrix().shifted_solve(self.scale, ridge * self.scale, rhs)"),
    ("ridge: a Cholesky for every r > 0", "mhla_cli/linalg/factorization.py", "        if ridge > tol:\n",
     "        if ridge > 0:\n"),
    ("ridge: the range solve keeps the null part", "mhla_cli/linalg/backends.py", "return x - N @ (N.T @ x)",
     "return x"),
    ("the verdict from lambda_min, not the proof", "mhla_cli/solve/certificate.py",
     'identifiable = proof == "cholesky of Lambda~ - t I"',
     'identifiable = proof in ("cholesky of Lambda~ - t I", "cholesky of Lambda~ - t I failed")'),
]

CONSTANTS = ["EPS", "RANK_FACTOR", "STRUCTURE_FACTOR", "OBSERVED_SPAN_FACTOR", "DETERMINED_TOL", "LANCZOS_TOL",
             "MSE_RESOLUTION_FACTOR", "SINGULAR_BASIS_COND", "SYMMETRY_TOL", "ORTHOGONAL_TOL", "DEAD_WEIGHT_TOL",
             "NONZERO_REL", "REFINE_MAX_RHO", "UNRESOLVED_REL", "EQUILIBRATE_RATIO", "CANONICAL_TOL",
             "CANONICAL_COEF_TOL", "W_COEF_TOL", "MAX_EXACT_INT", "SST_RESOLUTION", "RELIABLE_GAP", "ORTHONORMAL_TOL",
             "FOLD_SUM_TOL", "FEWEST_TOL", "LAMBDA_FLOOR_FRACTION"]

# Changes that no test can see because they change no answer (they are reported, not asserted):
EQUIVALENT = {
    "LANCZOS_TOL x1e-4": "a tighter Lanczos residual only costs iterations (lambda is already ~1e-14 relative)",
    "REFINE_MAX_RHO x1e-4": "the fit then factors Lambda~ itself instead of refining with the proof's factor: "
                            "the same answer, one more Cholesky",
    "ORTHOGONAL_TOL x1e-4": "a change of coordinates orthogonal to 1e-16 is then factorized again rather than "
                            "shared: the same spectrum",
    "ORTHOGONAL_TOL x1e4": "the shared block's change of coordinates R is orthogonal to rounding or far from it",
    "ridge: a Cholesky for every r > 0": "on exact nulls the Cholesky of Lambda~ + r I fails for r below rounding "
                                         "and the range solve answers; the guard r > tol is defence for "
                                         "eigenvalues within rounding of the tolerance",
    "ridge: the range solve keeps the null part": "the null part of the solve is rounding / lambda_max (the "
                                                  "review's pinv-keeps-null-part, killed by test_structure)",
}


def _constant_mutations() -> list[tuple[str, str, str, str]]:
    src = (ROOT / "mhla_cli" / "numerics.py").read_text(encoding="utf-8")
    out = []
    for name in CONSTANTS:
        # the value without its trailing comment (a comment inside the parentheses would be a syntax
        # error: every test would "kill" the mutation)
        line = re.search(rf"^{name} = ([^#\n]+?)[ \t]*(#[^\n]*)?$", src, flags=re.M)
        assert line, name
        for factor in ("1e4", "1e-4"):
            out.append((f"{name} x{factor}", "mhla_cli/numerics.py", line.group(0),
                        f"{name} = ({line.group(1)}) * {factor}"))
    return out


MUTATIONS = REVIEW + _constant_mutations()
BOUNDARY = ["tests/test_numerics.py", "tests/test_factorization.py", "-k", "cut_ or spectral_ridge"]

# Issue 36: every check of export-heads, spectrum and compare evaluated in the tokens' own coordinates (or on
# the coefficients instead of the outputs), each of which tests/test_canonical.py or test_compare.py must see.
OWN_COORDINATES = [
    ("heads, spectrum and --fewest in the tokens' own coordinates", "mhla_cli/model/canonical.py",
     "    if isinstance(fn, Model) and fn.coef_b is not None and fn.basis is not None:\n        basis = np.array(",
     "    if isinstance(fn, Model) and fn.coef_b is not None and fn.basis is not None and False:\n"
     "        basis = np.array("),
    ("the spectrum of the own coefficients", "mhla_cli/solve/spectrum.py",
     "    cf = _scaled(fn)\n    coef = cf.coef\n    d = coef.shape[0]\n    if W is None:",
     "    cf = canonical_function(fn.coef if isinstance(fn, Model) else fn)\n    coef = cf.coef\n"
     "    d = coef.shape[0]\n    if W is None:"),
    ("the reported change on the coefficients", "mhla_cli/model/canonical.py",
     '        return {"function_change": self.function_change(c_new),',
     '        return {"function_change": self.coef_change(c_new),'),
    ("--fewest cut on the coefficients", "mhla_cli/model/canonical.py",
     "        f = self.function_change(c_new)\n        return self.coef_change(c_new) if f is None else f",
     "        return self.coef_change(c_new)"),
    ("--fewest's lower bound without the data", "mhla_cli/solve/lowrank/fewest.py", "radius=cf.radius(tol))",
     "radius=None)"),
    ("--max-heads auto polished in the coefficients of H(Z)", "mhla_cli/solve/spectrum.py",
     "metric=cf.metric)", "metric=np.eye(cf.coef.shape[1]))"),
    ("compare --on judged by the own-coordinate distance", "mhla_cli/model/compare.py",
     '        out["judged_by"], rel = "data", out["relative_rms_difference"]',
     '        out["judged_by"], rel = "data", out["relative_distance"]'),
    ("compare judged by the own-coordinate distance on the training data", "mhla_cli/model/compare.py",
     '        out["judged_by"], rel = "training data", out["function_change"]',
     '        out["judged_by"], rel = "training data", out["relative_distance"]'),
    ("compare --on evaluates a model's own coefficients", "mhla_cli/model/compare.py",
     "    (pa, basis_a), (pb, basis_b) = evaluated(a), evaluated(b)",
     "    (pa, basis_a), (pb, basis_b) = (coef_of(a), None), (coef_of(b), None)"),
]
CANONICAL = ["tests/test_canonical.py", "tests/test_compare.py"]


def run_mutation(repo: Path, path: str, old: str, new: str, tests: list[str] | None = None) -> tuple[bool, str]:
    """Apply one mutation to the copy `repo`, run the boundary tests (or `tests`), revert; (killed, pytest's
    last line)."""
    full = repo / path
    src = full.read_text(encoding="utf-8")
    assert src.count(old) == 1, (path, old, src.count(old))
    full.write_text(src.replace(old, new), encoding="utf-8")
    try:
        env = dict(os.environ, PYTHONPATH=str(repo), OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1")
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                            *(BOUNDARY if tests is None else tests)],
                           cwd=repo, env=env, capture_output=True, text=True, timeout=900)
        tail = (r.stdout.strip().splitlines() or ["?"])[-1]
        return r.returncode != 0, tail
    finally:
        full.write_text(src, encoding="utf-8")


def copy_repo(dest: Path) -> Path:
    """The package, its tests and docs (the boundary tests read docs/formats.md's table) in `dest`."""
    for sub in ("mhla_cli", "tests", "docs"):
        shutil.copytree(ROOT / sub, dest / sub, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    for f in ("pyproject.toml", "conftest.py"):
        if (ROOT / f).exists():
            shutil.copy(ROOT / f, dest / f)
    return dest


@pytest.mark.slow
def test_every_mutation_fails_a_boundary_test(tmp_path: Path) -> None:
    repo = copy_repo(tmp_path / "repo")
    killed, lines = {}, []
    for name, path, old, new in MUTATIONS:
        k, tail = run_mutation(repo, path, old, new)
        killed[name] = k
        lines.append(f"{name}: {'killed' if k else 'SURVIVED'} ({tail})")
    print("\n".join(lines))
    survivors = [n for n, k in killed.items() if not k and n not in EQUIVALENT]
    assert not survivors, "\n".join(lines)


@pytest.mark.slow
def test_every_own_coordinate_check_fails_a_test(tmp_path: Path) -> None:
    repo = copy_repo(tmp_path / "repo")
    lines = []
    for name, path, old, new in OWN_COORDINATES:
        k, tail = run_mutation(repo, path, old, new, CANONICAL)
        lines.append(f"{name}: {'killed' if k else 'SURVIVED'} ({tail})")
    print("\n".join(lines))
    assert all(line.split(": ")[1].startswith("killed") for line in lines), "\n".join(lines)


if __name__ == "__main__":  # the table: python tests/test_mutations.py [NAME ...]
    import tempfile

    only = set(sys.argv[1:])
    with tempfile.TemporaryDirectory() as tmp:
        repo = copy_repo(Path(tmp) / "repo")
        for name, path, old, new in MUTATIONS:
            if only and name not in only:
                continue
            k, tail = run_mutation(repo, path, old, new)
            note = "" if k or name not in EQUIVALENT else f" [equivalent: {EQUIVALENT[name]}]"
            print(f"| {name} | {'killed' if k else 'SURVIVED'} | {tail}{note} |", flush=True)
