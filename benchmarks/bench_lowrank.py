"""Low-rank fits from few samples: held-out MSE and relative p error vs N (issue 5, item 2).

1- and 2-head random teachers, d = 6 and 8 (psi = 126, 288), Gaussian tokens, sequence length 20,
noise-free and noisy (label noise 0.05 on outputs of RMS 1). Methods, all on the statistics:
  lstsq       minimum-norm least squares (Algorithm 1)
  ridge       ridge, penalty tuned on an independent validation set of N samples
  nuclear     loss + LAMBDA ||W||_* (FISTA), LAMBDA tuned on the same validation set
  factorised  H heads (the teacher's H), ALS + Levenberg-Marquardt, 10 starts, no weight decay
"Needed" = relative p error <= 1e-4 (noise-free) or excess held-out MSE <= 1.5 x noise^2 (noisy;
the test targets are noise-free, so the held-out MSE is the excess risk).

Run: python benchmarks/bench_lowrank.py            (d = 6 and 8; about 3 minutes on 1 core)
     python benchmarks/bench_lowrank.py --quick    (d = 6 only)
     python benchmarks/bench_lowrank.py --dims 6 7 8
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
from threadpoolctl import threadpool_limits

from mhla_cli import lowrank, synthetic
from mhla_cli.features import n_features
from mhla_cli.forward import predict
from mhla_cli.solve import fit
from mhla_cli.stream import chunk_features

SEQ = 20
N_TEST = 2000
NOISE = 0.05
METHODS = ("lstsq", "ridge", "nuclear", "factorised")


def data(d: int, H: int, N: int, noise: float, seed: int) -> tuple[synthetic.Dataset, synthetic.Heads]:
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


def run_one(d: int, H: int, N: int, noise: float, seed: int) -> dict[str, tuple[float, float, float]]:
    tr, va, te, teacher = split(d, H, N, noise, seed)
    ft, fv = feats_of(tr, d), feats_of(va, d)
    p_true = teacher.coef
    res: dict[str, tuple[float, float, float]] = {}

    def record(name: str, coef: np.ndarray, t0: float) -> None:
        res[name] = (float(np.linalg.norm(coef - p_true) / np.linalg.norm(p_true)), test_mse(coef, te),
                     time.perf_counter() - t0)

    t0 = time.perf_counter()
    record("lstsq", fit(ft).coef, t0)
    t0 = time.perf_counter()
    scale = float(np.trace(ft.gram)) / (ft.n_samples * ft.n_features)
    best = min((lowrank.mse(fv, fit(ft, ridge=r * scale).coef), r) for r in 10.0 ** np.arange(-8, 1))
    record("ridge", fit(ft, ridge=best[1] * scale).coef, t0)
    t0 = time.perf_counter()
    lmax = lowrank.nuclear_lambda_max(ft)
    W0, cands = None, []
    for k in range(1, 7):
        lam = lmax * 10.0 ** (-k)
        r = lowrank.fit_nuclear(ft, lam, W0=W0, max_iter=1500, tol=1e-8)
        W0 = r.W
        cands.append((lowrank.mse(fv, r.coef), k, r.coef))
    record("nuclear", min(cands, key=lambda c: c[0])[2], t0)
    t0 = time.perf_counter()
    record("factorised", lowrank.fit_factorised(ft, H, restarts=10, seed=seed).coef, t0)
    return res


def needed(r: tuple[float, float, float], noise: float) -> bool:
    return r[0] <= 1e-4 if noise == 0 else r[1] <= 1.5 * noise**2


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="d = 6 only")
    ap.add_argument("--dims", type=int, nargs="+", default=[6, 8], help="token dimensions (default 6 8)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    dims = (6,) if args.quick else tuple(args.dims)
    fracs = (1 / 8, 1 / 4, 1 / 2, 1, 2)
    rows, smallest = [], {}
    t_start = time.perf_counter()
    with threadpool_limits(1):
        for d in dims:
            psi = n_features(d)
            for H in (1, 2):
                for noise in (0.0, NOISE):
                    key = (d, H, noise)
                    smallest[key] = {m: None for m in METHODS}
                    for fr in fracs:
                        N = max(4, int(round(fr * psi)))
                        res = run_one(d, H, N, noise, args.seed + 100 * d + 10 * H)
                        print(f"d={d} H={H} noise={noise:g} N={N}: "
                              + ", ".join(f"{m} {res[m][0]:.1e}" for m in METHODS), file=sys.stderr)
                        rows.append((d, psi, H, noise, N, res))
                        for m in METHODS:
                            if smallest[key][m] is None and needed(res[m], noise):
                                smallest[key][m] = N
    print(f"# bench_lowrank: held-out MSE (noise-free test targets, {N_TEST} sequences) and relative p error\n")
    print("| d | psi | H | noise | N | " + " | ".join(f"{m} p-err / MSE" for m in METHODS) + " |")
    print("|---|---|---|---|---|" + "---|" * len(METHODS))
    for d, psi, H, noise, N, res in rows:
        cells = " | ".join(f"{res[m][0]:.1e} / {res[m][1]:.1e}" for m in METHODS)
        print(f"| {d} | {psi} | {H} | {noise:g} | {N} | {cells} |")
    print("\n## Smallest N needed (p error <= 1e-4 noise-free; held-out MSE <= 1.5 noise^2 noisy); "
          "'>' = not reached by 2 psi\n")
    print("| d | psi | H | noise | " + " | ".join(METHODS) + " |")
    print("|---|---|---|---|" + "---|" * len(METHODS))
    for (d, H, noise), sm in smallest.items():
        psi = n_features(d)
        cells = " | ".join(str(sm[m]) if sm[m] is not None else f"> {2 * psi}" for m in METHODS)
        print(f"| {d} | {psi} | {H} | {noise:g} | {cells} |")
    tot = {m: sum(r[5][m][2] for r in rows) for m in METHODS}
    print("\nfit time per method (s, summed): " + ", ".join(f"{m} {t:.1f}" for m, t in tot.items())
          + f"; total {time.perf_counter() - t_start:.0f} s")


if __name__ == "__main__":
    main()
