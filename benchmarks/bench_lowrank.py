"""Low-rank fits from few samples: held-out MSE and relative p error vs N (issue 5, item 2).

1- and 2-head random teachers, d = 6 and 8 (psi = 126, 288), Gaussian tokens, sequence length 20,
noise-free and noisy (label noise 0.05 on outputs of RMS 1). Methods, all on the statistics:
  lstsq       minimum-norm least squares (Algorithm 1)
  ridge       ridge, penalty tuned on an independent validation set of N more samples
  nuclear     loss + LAMBDA ||W||_* (FISTA), LAMBDA tuned on the same validation set
  factorised  H heads (given the teacher's true H), ALS + Levenberg-Marquardt, 10 starts, no weight decay
So ridge and nuclear see 2N labelled samples (N to fit, N to tune) and factorised is told H: the
comparison is of what each method can do with what it is given, not of equal information.
"Needed" = relative p error <= 1e-4 (noise-free) or excess held-out MSE <= 1.5 x noise^2 (noisy;
the test targets are noise-free, so the held-out MSE is the excess risk).

For each setting and seed the methods are run on the grid N = psi x 1.25^k (N = psi included) from
0.1 psi to 2 psi; a method's "smallest N" is the first grid N where its criterion holds, found by
an ascending scan (lstsq, ridge, factorised) or, for the slow nuclear fit, by bisection on the grid
(assumes the criterion holds at every N above the first; the grid point below is checked to fail).
Reported: median [range] over --seeds (default 3) seeds.

Run: python benchmarks/bench_lowrank.py            (d = 6, 3 seeds; a few minutes on 1 core)
     python benchmarks/bench_lowrank.py --quick    (d = 6, 1 seed)
     python benchmarks/bench_lowrank.py --dims 6 8 (adds d = 8, psi = 288; much slower)
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from threadpoolctl import threadpool_limits

from mhla_cli.solve import lowrank
from mhla_cli.model import synthetic
from mhla_cli.feature_map import n_features
from mhla_cli.model.forward import predict
from mhla_cli.solve.lstsq import fit
from mhla_cli.statistics.accumulate import chunk_features
from mhla_cli.model.heads import Heads

SEQ = 20
N_TEST = 2000
NOISE = 0.05
METHODS = ("lstsq", "ridge", "nuclear", "factorised")


def data(d: int, H: int, N: int, noise: float, seed: int) -> tuple[synthetic.Dataset, Heads]:
    return synthetic.generate_teacher(d, H, N, SEQ, noise=noise, seed=seed)


def split(d: int, H: int, n_train: int, noise: float, seed: int):
    """One teacher; train, validation (same size) and a noise-free test set drawn from it."""
    full, teacher = data(d, H, 2 * n_train + N_TEST, 0.0, seed)
    rng = np.random.default_rng(seed + 1)
    y = full.targets + noise * rng.standard_normal(full.targets.shape)

    def part(lo: int, hi: int, noisy: bool) -> synthetic.Dataset:
        a, b = full.offsets[lo], full.offsets[hi]
        return synthetic.Dataset(full.tokens[a:b], full.offsets[lo:hi + 1] - a, (y if noisy else full.targets)[lo:hi])

    return (part(0, n_train, True), part(n_train, 2 * n_train, True),
            part(2 * n_train, 2 * n_train + N_TEST, False), teacher)


def feats_of(ds: synthetic.Dataset, d: int):
    return chunk_features(ds.tokens, ds.offsets, ds.targets, d)


def test_mse(coef: np.ndarray, ds: synthetic.Dataset) -> float:
    return float(np.mean((predict(coef, ds.tokens, ds.offsets) - ds.targets) ** 2))


def run_one(d: int, H: int, N: int, noise: float, seed: int,
            methods: tuple[str, ...] = METHODS) -> dict[str, tuple[float, float, float]]:
    """(relative p error, held-out MSE, seconds) of each method in `methods` at N training samples."""
    tr, va, te, teacher = split(d, H, N, noise, seed)
    ft, fv = feats_of(tr, d), feats_of(va, d)
    p_true = teacher.coef
    res: dict[str, tuple[float, float, float]] = {}

    def record(name: str, coef: np.ndarray, t0: float) -> None:
        res[name] = (float(np.linalg.norm(coef - p_true) / np.linalg.norm(p_true)), test_mse(coef, te),
                     time.perf_counter() - t0)

    if "lstsq" in methods:
        t0 = time.perf_counter()
        record("lstsq", fit(ft).coef, t0)
    if "ridge" in methods:
        t0 = time.perf_counter()
        # the ridge acts on the canonical coefficients: grid relative to the mean canonical eigenvalue
        scale = float(np.trace(ft.solver_stats()[1])) / (ft.n_samples * ft.n_features)
        best = min((lowrank.mse(fv, fit(ft, ridge=r * scale).coef), r) for r in 10.0 ** np.arange(-8, 1))
        record("ridge", fit(ft, ridge=best[1] * scale).coef, t0)
    if "nuclear" in methods:
        t0 = time.perf_counter()
        lmax = lowrank.nuclear_lambda_max(ft)
        W0, cands = None, []
        for k in range(1, 7):
            lam = lmax * 10.0 ** (-k)
            r = lowrank.fit_nuclear(ft, lam, W0=W0, max_iter=1500, tol=1e-8)
            W0 = r.W
            cands.append((lowrank.mse(fv, r.coef), k, r.coef))
        record("nuclear", min(cands, key=lambda c: c[0])[2], t0)
    if "factorised" in methods:
        t0 = time.perf_counter()
        record("factorised", lowrank.fit_factorised(ft, H, restarts=10, seed=seed).coef, t0)
    return res


def needed(r: tuple[float, float, float], noise: float) -> bool:
    return r[0] <= 1e-4 if noise == 0 else r[1] <= 1.5 * noise**2


GIVEN = {
    "lstsq": "training set only",
    "ridge": "training set + N extra validation samples (penalty from 10^-8..10^0 x the mean eigenvalue of the canonical Lambda~)",
    "nuclear": "training set + N extra validation samples (LAMBDA from lambda_max x 10^-1..10^-6)",
    "factorised": "training set + the teacher's true head count H (10 starts, no weight decay)",
}


BISECT = {"lstsq": False, "ridge": False, "nuclear": True, "factorised": False}


def first_success(ok, n: int, bisect: bool) -> int | None:
    """Index of the first grid point where ok(i) holds (None if none).

    Ascending scan, or (bisect=True, for the slow nuclear fit) bisection, which assumes that the
    criterion, once met, holds at every larger N: it checks the largest N, then halves the interval
    between a failing and a succeeding point, so the returned point succeeds and the one below fails.
    """
    if not bisect:
        return next((i for i in range(n) if ok(i)), None)
    if not ok(n - 1):
        return None
    lo, hi = -1, n - 1          # ok(hi) holds; lo = -1 stands for "below the grid"
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if ok(mid):
            hi = mid
        else:
            lo = mid
    return hi


def grid(psi: int, factor: float, lo: float, hi: float) -> list[int]:
    """N = psi * factor^k for psi*lo <= N <= psi*hi (k integer, so N = psi is on the grid), rounded."""
    ks = range(int(np.ceil(np.log(lo) / np.log(factor) - 1e-9)), int(np.floor(np.log(hi) / np.log(factor) + 1e-9)) + 1)
    return sorted({max(4, int(round(psi * factor**k))) for k in ks})


def summarise(vals: list[int | None], top: int, bottom: int) -> str:
    """median [min-max] over seeds; None = not reached (counted as +inf in the median).

    A method that succeeds at the grid's smallest N may need fewer: shown as '<= N'.
    """
    def f(v: float) -> str:
        return f"<= {v:g}" if v == bottom else f"{v:g}"

    reached = sorted(v for v in vals if v is not None)
    n = len(vals)
    if not reached:
        return f"> {top} ({n}/{n} not reached)"
    full = sorted(v if v is not None else np.inf for v in vals)
    med = full[(n - 1) // 2] if n % 2 else (full[n // 2 - 1] + full[n // 2]) / 2
    med_s = f"> {top}" if not np.isfinite(med) else f(med)
    rng_s = (f(reached[0]) if reached[0] == reached[-1] else f"{f(reached[0])}-{reached[-1]}") + (f", {n - len(reached)} not reached" if len(reached) < n else "")
    return f"{med_s} [{rng_s}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="d = 6 only, 1 seed")
    ap.add_argument("--dims", type=int, nargs="+", default=[6], help="token dimensions (default 6)")
    ap.add_argument("--seeds", type=int, default=3, help="teachers / data sets per setting (default 3)")
    ap.add_argument("--factor", type=float, default=1.25, help="grid step: N = psi * factor^k (default 1.25)")
    ap.add_argument("--lo", type=float, default=0.1, help="smallest N / psi (default 0.1)")
    ap.add_argument("--hi", type=float, default=2.0, help="largest N / psi (default 2)")
    args = ap.parse_args()
    dims = (6,) if args.quick else tuple(args.dims)
    seeds = 1 if args.quick else args.seeds
    t_start = time.perf_counter()
    tot = {m: 0.0 for m in METHODS}
    table: dict[tuple[int, int, float], dict[str, list[int | None]]] = {}
    grids = {}
    with threadpool_limits(1):
        for d in dims:
            psi = n_features(d)
            Ns = grids[d] = grid(psi, args.factor, args.lo, args.hi)
            for H in (1, 2):
                for noise in (0.0, NOISE):
                    per = table[(d, H, noise)] = {m: [] for m in METHODS}
                    for s in range(seeds):
                        seed = 1000 * s + 100 * d + 10 * H
                        cache: dict[tuple[str, int], tuple[float, float, float]] = {}

                        def ok(m: str, i: int) -> bool:
                            if (m, i) not in cache:
                                r = run_one(d, H, Ns[i], noise, seed, (m,))[m]
                                cache[(m, i)] = r
                                tot[m] += r[2]
                                print(f"d={d} H={H} noise={noise:g} seed={seed} N={Ns[i]}: {m} "
                                      f"p-err {r[0]:.1e}, MSE {r[1]:.1e}", file=sys.stderr)
                            return needed(cache[(m, i)], noise)

                        for m in METHODS:
                            per[m].append(first_success(lambda i: ok(m, i), len(Ns), BISECT[m]))
                            per[m][-1] = None if per[m][-1] is None else Ns[per[m][-1]]
    print(f"# bench_lowrank: smallest N reaching relative p error <= 1e-4 (noise-free) or held-out excess MSE "
          f"<= 1.5 x {NOISE}^2 (noise {NOISE}; {N_TEST} noise-free test sequences)\n")
    for d in dims:
        print(f"d = {d} (psi = {n_features(d)}): grid N = {', '.join(map(str, grids[d]))} "
              f"(psi x {args.factor:g}^k); the smallest grid N where the criterion holds\n")
    print("Search: ascending scan for lstsq, ridge, factorised; bisection on the grid for nuclear.\n")
    print(f"Median [range] over {seeds} seed(s) (each seed: a new teacher, data and starts); "
          f"'> N' = not reached on the grid, "
          f"'<= N' = reached at the grid's smallest N\n")
    print("| d (psi) | heads | noise | " + " | ".join(METHODS) + " |")
    print("|---|---|---|" + "---|" * len(METHODS))
    for (d, H, noise), per in table.items():
        top = grids[d][-1]
        print(f"| {d} ({n_features(d)}) | {H} | {noise:g} | "
              + " | ".join(summarise(per[m], top, grids[d][0]) for m in METHODS) + " |")
    print("\nper seed: " + "; ".join(f"d={d} H={H} noise={noise:g}: "
                                     + ", ".join(f"{m} {per[m]}" for m in METHODS)
                                     for (d, H, noise), per in table.items()))
    print("\nWhat each method was given:\n" + "\n".join(f"- {m}: {g}" for m, g in GIVEN.items()))
    print("\nfit time per method (s, summed, 1 BLAS thread): " + ", ".join(f"{m} {t:.1f}" for m, t in tot.items())
          + f"; total {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
