"""Issue 15 ("Large psi") acceptance benchmark: featurize, certify and fit at psi in the thousands.

Every number is a ratio to a bare LAPACK / BLAS call measured in the same run on the same machine
(the machine is printed with the tables; a shared machine makes absolute times noisy, same-run ratios
much less so).

1. Dense Gaussian teachers, d = 24 (psi = 7200) and d = 32 (psi = 16896) by default: N = 9000
   sequences of 30 float32 Gaussian tokens, targets from a random d^2-head teacher (a generic, dense
   W; mhla_cli.model.synthetic.generate_teacher). Each step is a FRESH process running the `mhla` CLI with
   the default BLAS threads: `featurize`, `certify --json`, `fit --json -o model.h5`; its wall time and
   peak RSS (getrusage RUSAGE_CHILDREN in a wrapper process, as in bench_memory.py) are recorded. In
   the same run, each in a fresh process: a bare Cholesky (scipy.linalg.cho_factor, lower, of a random
   SPD psi x psi float64 matrix; best of --bare-repeat) and a bare float64 dsyrk (scipy) of blocks of
   featurize's chunk size (rows = stream.default_chunk_size of the file) x psi columns, with the BLAS
   threads featurize's syrk uses (one below stream.MIN_THREADED_WIDTH columns).
   Targets (PASS / FAIL printed per target):
     featurize GFLOP/s >= 60 % of the dsyrk's; GFLOP/s = N psi (psi + 1) / process wall time, the
       flops of the syrk of the N x psi feature matrix (as bench_gflops.py counts them); the table also
       gives the same ratio as times (featurize process / the dsyrk of the N x psi features at the
       dsyrk's rate: issue 24's targets, <= 0.75 at d = 16, 24 and <= 1.0 at d = 24, N = 9000);
     certify / Cholesky <= 2 and fit / Cholesky <= 2 (whole process wall time / bare Cholesky);
     peak RSS of every step below 3 psi^2 * 8 bytes + 300 MiB.
   Also printed: the `seconds` breakdown of certify --json and fit --json (load, eigenvalues /
   cholesky / lanczos / eigenvectors, solve); the process wall time also holds the interpreter
   start-up, imports, the canonical transform and writing. Note that certification needs N >= psi: at
   N < psi (d = 32 with N = 9000, d = 16 in --quick) the data are NOT identifiable, certify exits 1
   (recorded, not an error) and both steps take the eigenvector path (~9 psi^3 flops, not psi^3 / 3).

2. DFA executor points (experiments/dfa_executor.py `run_point`, loaded by path in a fresh process
   whose mhla_cli is the code under test; 1 BLAS thread via the experiment's limit_threads; words of
   L = 6 symbols, 30 held-out DFAs with words of 4L, seed 0, as the experiment's main): Q = S = 4 with
   N = 320 traces (the experiment's --point 4 4 320), and with --dfa-large also Q = 5, S = 4 (N = 400)
   and Q = S = 5 (N = 500). Per-step seconds, verdicts (full / observed certificate and rank),
   held-out accuracy and max error, undetermined probes of certify --on.
   --baseline-ref REF (default ff4215a, the code before the issue-15 work; `none` skips it): the
   first DFA point measured again, right after the current code's, with REF checked out by
   `git worktree add` into a temporary directory (PYTHONPATH and cwd pointing at it; removed with
   `git worktree remove --force` afterwards). Reported: the end-to-end speedup (run_point wall time,
   REF / current; target >= 10x) and whether verdicts and errors are the same. "Current" is the
   working tree, uncommitted changes included (listed in the JSON).

The script always exits 0: it is a measurement. JSON: benchmarks/out/bench_large.json
(bench_large_quick.json with --quick; --json PATH to choose).

Run:
    python benchmarks/bench_large.py                    # full: d = 24, 32, N = 9000; DFA 4 4 320 + baseline
    python benchmarks/bench_large.py --quick            # d = 12, 16, N = 2000; DFA 3 2 40 + baseline (a minute)
    python benchmarks/bench_large.py --dfa-large        # adds the DFA points Q=5 S=4 and Q=S=5
    python benchmarks/bench_large.py --baseline-ref REF # another baseline commit (none: no baseline)
    python benchmarks/bench_large.py --d 24 --n-seq 12000 --no-dfa
    python benchmarks/bench_large.py --no-dense --dfa-point 4 4 320 --dfa-point 4 3 160
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import h5py

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import OUT, machine, mhla_cmd, table  # noqa: E402

from mhla_cli.model import synthetic  # noqa: E402
from mhla_cli.linalg.backends import POTRF_THREADED_MAX  # noqa: E402
from mhla_cli.feature_map import n_features  # noqa: E402
from mhla_cli.statistics.ranges import default_chunk_size  # noqa: E402
from mhla_cli.io.tokens import inspect_tokens  # noqa: E402

try:
    from mhla_cli.linalg.backends import MIN_THREADED_WIDTH
except ImportError:  # pragma: no cover
    MIN_THREADED_WIDTH = 1024

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_BASELINE = "ff4215a"
DFA_L, DFA_N_TEST, DFA_SEED = 6, 30, 0

TARGET_FEATURIZE = 0.60  # featurize GFLOP/s / dsyrk GFLOP/s, at least
TARGET_CHOL = 2.0  # certify / Cholesky and fit / Cholesky, at most
TARGET_SPEEDUP = 10.0  # DFA point end to end, baseline / current, at least

# Runs argv[1:] as a child; prints its wall time, exit code, peak RSS and stdout as one JSON line.
WRAP = ("import json, resource, subprocess, sys, time; t = time.perf_counter(); "
        "p = subprocess.run(sys.argv[1:], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True); "
        "print(json.dumps({'wall': time.perf_counter() - t, 'rc': p.returncode, "
        "'maxrss_kib': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, "
        "'stdout': p.stdout, 'stderr': p.stderr[-2000:]}))")

# A bare float64 dsyrk of (rows x psi) blocks: argv psi rows repeat threads (0 = BLAS default).
BARE_SYRK = """
import json, sys, time
import numpy as np, scipy.linalg.blas as sblas
from threadpoolctl import threadpool_limits
psi, rows, repeat, threads = map(int, sys.argv[1:5])
with threadpool_limits(limits=threads or None):
    rng = np.random.default_rng(0)
    F = np.asfortranarray(rng.standard_normal((rows, psi)))
    C = np.zeros((psi, psi), order="F")
    sblas.dsyrk(1.0, F, beta=0.0, c=C, trans=1, lower=0, overwrite_c=1)  # warm-up
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        sblas.dsyrk(1.0, F, beta=1.0, c=C, trans=1, lower=0, overwrite_c=1)
        times.append(time.perf_counter() - t)
print(json.dumps({"seconds": times, "best": min(times), "gflops": rows * psi * (psi + 1) / min(times) / 1e9}))
"""

# A bare Cholesky (scipy cho_factor, lower, as mhla_cli.linalg.factorization) of a random SPD matrix: argv psi repeat.
# Only the lower triangle is read: entries in [0, 1) below a diagonal of psi + 1 make the symmetric
# matrix it defines strictly diagonally dominant, hence SPD (and well conditioned).
BARE_CHOL = """
import json, sys, time
import numpy as np, scipy.linalg as sl
from mhla_cli.linalg.factorization import cholesky  # scipy's cho_factor, one BLAS thread where OpenBLAS's crashes
psi, repeat = map(int, sys.argv[1:3])
M = np.random.default_rng(0).random((psi, psi))
M[np.diag_indices(psi)] += psi + 1.0
A = np.empty_like(M, order="F")
times = []
for _ in range(repeat):
    A[...] = M
    t = time.perf_counter()
    cholesky(A, overwrite_a=True)
    times.append(time.perf_counter() - t)
print(json.dumps({"seconds": times, "best": min(times)}))
"""

# One DFA executor point with the code under argv[1] (its experiments/dfa_executor.py, its mhla_cli).
DFA_CHILD = """
import importlib.util, json, sys, tempfile, time
from pathlib import Path
root = Path(sys.argv[1]).resolve()
Q, S, N, L, n_test, seed = map(int, sys.argv[2:8])
sys.path[:0] = [str(root / "experiments"), str(root)]
spec = importlib.util.spec_from_file_location("dfa_executor", root / "experiments" / "dfa_executor.py")
mod = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mod)
mod.limit_threads(1)
import mhla_cli
with tempfile.TemporaryDirectory() as tmp:
    t = time.perf_counter()
    r = mod.run_point(Q, S, N, L, n_test, seed, Path(tmp))
    r["run_point_seconds"] = time.perf_counter() - t
r["mhla_cli_file"] = str(Path(mhla_cli.__file__).resolve())
print(json.dumps(r, default=lambda o: o.item() if hasattr(o, "item") else str(o)))
"""


def wrapped(cmd: list[str], env: dict | None = None, cwd: Path | None = None) -> dict[str, Any]:
    """Run `cmd` as a fresh process: wall, rc, peak RSS (KiB), its stdout (and the tail of its stderr)."""
    out = subprocess.run([sys.executable, "-c", WRAP, *cmd], check=True, capture_output=True, text=True,
                         env=env, cwd=cwd)
    return json.loads(out.stdout.strip().splitlines()[-1])


def last_json(text: str) -> dict[str, Any]:
    """The JSON object a child printed last on stdout."""
    for line in reversed(text.strip().splitlines()):
        line = line.strip()
        if line.startswith("{"):
            return json.loads(line)
    start = text.find("{")
    return json.loads(text[start:]) if start >= 0 else {}


def python_snippet(code: str, *argv: object, env: dict | None = None, cwd: Path | None = None) -> dict[str, Any]:
    """A fresh `python -c code argv...` under the RSS wrapper; its printed JSON merged with wall / RSS."""
    r = wrapped([sys.executable, "-c", code, *map(str, argv)], env=env, cwd=cwd)
    if r["rc"] != 0:
        raise RuntimeError(f"child failed (rc {r['rc']}): {r['stderr']}")
    return {**last_json(r["stdout"]), "process_wall": r["wall"], "maxrss_mib": r["maxrss_kib"] / 1024}


def mib(kib: float) -> float:
    return kib / 1024


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


# --------------------------------------------------------------------------------------------
# 1. dense teachers
# --------------------------------------------------------------------------------------------


def teacher_file(N: int, n: int, d: int, seed: int = 0) -> Path:
    """Tokens (N, n, d) float32 + targets of a random d^2-head teacher, uncompressed, cached under benchmarks/out."""
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"large_teacher_N{N}_n{n}_d{d}_s{seed}.h5"
    if path.exists():
        try:
            with h5py.File(path, "r") as f:
                if f["tokens"].shape == (N, n, d) and f["targets"].shape == (N, d):
                    return path
        except (OSError, KeyError):
            pass
    ds, _ = synthetic.generate_teacher(d, d * d, N, n, dtype="float32", seed=seed)
    tmp = path.with_name(path.stem + ".partial.h5")
    ds.save(tmp, dtype="float32", compression=None)
    os.replace(tmp, path)
    return path


def dense_point(d: int, N: int, n: int, repeat: int, workdir: Path) -> dict[str, Any]:
    psi = n_features(d)
    data = teacher_file(N, n, d)
    rows = default_chunk_size(inspect_tokens(data))
    syrk_threads = 0 if psi + d >= MIN_THREADED_WIDTH else 1
    if psi > POTRF_THREADED_MAX:
        # OpenBLAS's threaded syrk segfaults at this size (mhla_cli.linalg.factorization.POTRF_THREADED_MAX;
        # featurize itself adds GEMM panels, which do not): the bare syrk runs on one thread
        syrk_threads = 1
    feats, model = workdir / f"feats_d{d}.h5", workdir / f"model_d{d}.h5"
    r: dict[str, Any] = {"d": d, "psi": psi, "N": N, "n": n, "tokens": str(data), "chunk_rows": rows,
                         "flops": N * psi * (psi + 1), "bound_mib": 3 * psi**2 * 8 / 2**20 + 300}
    steps = {"featurize": ["featurize", str(data), "-o", str(feats), "-q"],
             "certify": ["certify", str(feats), "--json", "-q"],
             "fit": ["fit", str(feats), "-o", str(model), "--json", "-q"]}
    for step, args in steps.items():
        print(f"# d = {d} (psi = {psi}): mhla {step} ...", flush=True)
        w = wrapped(mhla_cmd(*args))
        ok_rc = (0, 1) if step == "certify" else (0,)  # certify exits 1 when not identifiable
        s = {"wall": w["wall"], "rc": w["rc"], "maxrss_mib": mib(w["maxrss_kib"])}
        if w["rc"] not in ok_rc:
            s["error"] = w["stderr"]
            print(f"  FAILED (rc {w['rc']}): {w['stderr'][-500:]}", flush=True)
        elif step != "featurize":
            out = last_json(w["stdout"])
            s["seconds"] = out.get("seconds", {})
            s["identifiable"] = out.get("identifiable")
            s["rank"] = out.get("rank")
            s["n_features"] = out.get("n_features")
        r[step] = s
        if "error" in s:
            break
    print(f"# d = {d}: bare dsyrk ({rows} x {psi}) and Cholesky ({psi} x {psi}) ...", flush=True)
    r["dsyrk"] = python_snippet(BARE_SYRK, psi, rows, repeat, syrk_threads)
    r["dsyrk"]["threads"] = ("default" if syrk_threads == 0 else
                             "1 (threaded syrk crashes)" if psi > POTRF_THREADED_MAX else syrk_threads)
    r["cholesky"] = python_snippet(BARE_CHOL, psi, repeat)
    for f in (feats, model):
        f.unlink(missing_ok=True)
    # ratios and targets
    chol = r["cholesky"]["best"]
    if "featurize" in r and "error" not in r["featurize"]:
        r["featurize"]["gflops"] = r["flops"] / r["featurize"]["wall"] / 1e9
        r["featurize_vs_dsyrk"] = r["featurize"]["gflops"] / r["dsyrk"]["gflops"]
    for step in ("certify", "fit"):
        if step in r and "error" not in r[step]:
            r[f"{step}_vs_cholesky"] = r[step]["wall"] / chol
    rss = [r[s]["maxrss_mib"] for s in steps if s in r]
    r["peak_rss_mib"] = max(rss) if rss else float("nan")
    r["pass"] = {"featurize >= 60% dsyrk": r.get("featurize_vs_dsyrk", 0.0) >= TARGET_FEATURIZE,
                 "certify <= 2 Cholesky": r.get("certify_vs_cholesky", float("inf")) <= TARGET_CHOL,
                 "fit <= 2 Cholesky": r.get("fit_vs_cholesky", float("inf")) <= TARGET_CHOL,
                 "peak RSS < bound": len(rss) == len(steps) and r["peak_rss_mib"] < r["bound_mib"]}
    return r


def dense_tables(results: list[dict[str, Any]]) -> str:
    nan = float("nan")
    g = lambda r, s, k: r.get(s, {}).get(k, nan)  # noqa: E731
    out = ["### featurize vs a bare dsyrk\n",
           table(["d", "psi", "N", "featurize s", "featurize GFLOP/s", "dsyrk block", "dsyrk threads",
                  "dsyrk GFLOP/s", "featurize / dsyrk", "target >= 60 %", "time: featurize / dsyrk of N x psi"],
                 [[r["d"], r["psi"], r["N"], g(r, "featurize", "wall"), g(r, "featurize", "gflops"),
                   f"{r['chunk_rows']} x {r['psi']}", r["dsyrk"]["threads"], r["dsyrk"]["gflops"],
                   f"{r.get('featurize_vs_dsyrk', nan):.0%}", verdict(r["pass"]["featurize >= 60% dsyrk"]),
                   f"{1.0 / r['featurize_vs_dsyrk']:.2f}" if r.get("featurize_vs_dsyrk") else "n/a"]
                  for r in results]),
           "\n### certify and fit vs a bare Cholesky\n",
           table(["d", "psi", "N", "identifiable (rank / psi)", "Cholesky s (best)", "certify s", "certify / Cholesky",
                  "target <= 2", "fit s", "fit / Cholesky", "target <= 2"],
                 [[r["d"], r["psi"], r["N"],
                   f"{'yes' if g(r, 'certify', 'identifiable') is True else 'no'} "
                   f"({g(r, 'certify', 'rank')} / {g(r, 'certify', 'n_features')})",
                   r["cholesky"]["best"], g(r, "certify", "wall"), r.get("certify_vs_cholesky", nan),
                   verdict(r["pass"]["certify <= 2 Cholesky"]), g(r, "fit", "wall"), r.get("fit_vs_cholesky", nan),
                   verdict(r["pass"]["fit <= 2 Cholesky"])] for r in results]),
           "\n### peak RSS (MiB, ru_maxrss of each fresh process)\n",
           table(["d", "psi", "featurize", "certify", "fit", "bare Cholesky", "bare dsyrk",
                  "bound 3 psi^2 * 8 B + 300 MiB", "largest step / bound", "target: below"],
                 [[r["d"], r["psi"], f"{g(r, 'featurize', 'maxrss_mib'):.0f}", f"{g(r, 'certify', 'maxrss_mib'):.0f}",
                   f"{g(r, 'fit', 'maxrss_mib'):.0f}", f"{r['cholesky']['maxrss_mib']:.0f}",
                   f"{r['dsyrk']['maxrss_mib']:.0f}", f"{r['bound_mib']:.0f}", r["peak_rss_mib"] / r["bound_mib"],
                   verdict(r["pass"]["peak RSS < bound"])] for r in results]),
           "\n### certify / fit `seconds` (from --json)\n"]
    keys: list[str] = []
    for r in results:
        for step in ("certify", "fit"):
            for k in r.get(step, {}).get("seconds", {}):
                if k not in keys:
                    keys.append(k)
    rows = []
    for r in results:
        for step in ("certify", "fit"):
            s = r.get(step, {})
            sec = s.get("seconds", {})
            rows.append([r["d"], r["psi"], step, s.get("wall", nan), *[sec.get(k, "-") for k in keys]])
    out.append(table(["d", "psi", "step", "process wall s", *keys], rows))
    out.append("\nThe steps are timed where mhla computes them: `solve` spans the solve, including a Cholesky or "
               "eigenvectors first needed there (the steps may overlap). The process wall time also holds the "
               "interpreter start-up, imports, the canonical transform and writing.")
    return "\n".join(out)


# --------------------------------------------------------------------------------------------
# 2. DFA executor points, and the baseline commit
# --------------------------------------------------------------------------------------------


def dfa_point(root: Path, Q: int, S: int, N: int, env_extra: dict[str, str] | None = None) -> dict[str, Any]:
    """One run_point of root's experiments/dfa_executor.py with root's mhla_cli, in a fresh process."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(root), *filter(None, [env.get("PYTHONPATH")])])
    env.update(env_extra or {})
    r = python_snippet(DFA_CHILD, root, Q, S, N, DFA_L, DFA_N_TEST, DFA_SEED, env=env, cwd=root)
    if not Path(r["mhla_cli_file"]).is_relative_to(root.resolve()):
        raise RuntimeError(f"the child imported {r['mhla_cli_file']}, not the mhla_cli of {root}")
    return r


@contextlib.contextmanager
def worktree(ref: str) -> Iterator[tuple[Path, str]]:
    """`git worktree add` of ref in a temporary directory (removed with --force afterwards)."""
    sha = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--verify", f"{ref}^{{commit}}"], check=True,
                         capture_output=True, text=True).stdout.strip()
    tmp = Path(tempfile.mkdtemp(prefix="mhla_baseline_"))
    path = tmp / "wt"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(path), sha], check=True,
                   capture_output=True, text=True)
    try:
        yield path, sha
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(path)], check=False,
                       capture_output=True, text=True)
        shutil.rmtree(tmp, ignore_errors=True)


def verdicts(r: dict[str, Any]) -> dict[str, Any]:
    return {"cert_full": (r["cert_full"]["identifiable"], r["cert_full"]["rank"]),
            "cert_observed": (r["cert_observed"]["identifiable"], r["cert_observed"]["rank"]),
            "undetermined": r["probes"]["n_undetermined"], "train_accuracy": r["train"]["accuracy"],
            "heldout_accuracy": r["heldout"]["accuracy"], "closed_loop_exact": r["closed_loop"]["exact_runs"]}


def same_error(a: float, b: float) -> bool:
    """Max errors agree: both at rounding level, or within 1e-6 relative."""
    return (a <= 1e-8 and b <= 1e-8) or abs(a - b) <= 1e-6 * max(abs(a), abs(b))


def compare(cur: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    vc, vb = verdicts(cur), verdicts(base)
    err = {k: (cur[k]["max_error"], base[k]["max_error"]) for k in ("train", "heldout")}
    return {"speedup": base["run_point_seconds"] / cur["run_point_seconds"],
            "step_speedup": {k: base["seconds"][k] / cur["seconds"][k] if cur["seconds"][k] > 0 else float("nan")
                             for k in cur["seconds"]},
            "same_verdicts": vc == vb, "verdicts_current": vc, "verdicts_baseline": vb,
            "same_errors": all(same_error(a, b) for a, b in err.values()), "max_errors": err}


def dfa_rows(results: list[dict[str, Any]]) -> list[list[object]]:
    rows = []
    for r in results:
        s, cf, co, pr = r["seconds"], r["cert_full"], r["cert_observed"], r["probes"]
        rows.append([r["code"], r["Q"], r["S"], r["d"], r["psi"], r["n_train"], s["featurize"], s["certify"], s["fit"],
                     s["probes"], s["closed_loop"], r["run_point_seconds"],
                     f"{'yes' if cf['identifiable'] else 'no'} ({cf['rank']}/{cf['n_features']})",
                     f"{'yes' if co['identifiable'] else 'no'} ({co['rank']}/{co['n_features']})",
                     f"{r['heldout']['accuracy']:.3f}", r["heldout"]["max_error"],
                     f"{pr['n_undetermined']} / {pr['n_probes']}"])
    return rows


DFA_HEADER = ["code", "Q", "S", "d", "psi", "N traces", "featurize s", "certify full+obs s", "fit s",
              "certify --on s", "closed loop s", "run_point s (end to end)", "full cert (rank/psi)",
              "observed cert (rank/dim)", "held-out acc (4L)", "held-out max err", "undetermined / probes"]


# --------------------------------------------------------------------------------------------


def code_state() -> dict[str, Any]:
    """HEAD of the tree under test and its uncommitted changes to tracked / untracked code files."""
    def git(*a: str) -> str:
        p = subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True)
        return p.stdout.strip() if p.returncode == 0 else "?"
    dirty = [ln for ln in git("status", "--porcelain", "--", "mhla_cli", "experiments").splitlines() if ln]
    return {"head": git("rev-parse", "HEAD"), "uncommitted": dirty}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="d = 12, 16, N = 2000, DFA point 3 2 40: checks the script")
    ap.add_argument("--d", type=int, nargs="+", default=None, help="dims of section 1 (default 24 32)")
    ap.add_argument("--n-seq", type=int, default=None, help="sequences N of section 1 (default 9000)")
    ap.add_argument("--seq-len", type=int, default=30)
    ap.add_argument("--bare-repeat", type=int, default=2, help="best of this many bare Cholesky / dsyrk calls")
    ap.add_argument("--dfa-point", type=int, nargs=3, metavar=("Q", "S", "N"), action="append",
                    help="DFA points (repeatable; default 4 4 320, --quick 3 2 40); the first one is compared "
                         "with the baseline")
    ap.add_argument("--dfa-large", action="store_true", help="add the DFA points 5 4 400 and 5 5 500")
    ap.add_argument("--baseline-ref", default=DEFAULT_BASELINE,
                    help=f"older commit for the DFA comparison (default {DEFAULT_BASELINE}; 'none' skips it)")
    ap.add_argument("--no-dense", action="store_true", help="skip section 1")
    ap.add_argument("--no-dfa", action="store_true", help="skip section 2")
    ap.add_argument("--json", type=Path, default=None, help="output JSON (default benchmarks/out/bench_large.json)")
    args = ap.parse_args()
    dims = args.d or ([12, 16] if args.quick else [24, 32])
    N = args.n_seq or (2000 if args.quick else 9000)
    points = [tuple(p) for p in args.dfa_point] if args.dfa_point else [(3, 2, 40) if args.quick else (4, 4, 320)]
    if args.dfa_large:
        points += [(5, 4, 400), (5, 5, 500)]
    json_path = args.json or OUT / ("bench_large_quick.json" if args.quick else "bench_large.json")
    OUT.mkdir(parents=True, exist_ok=True)
    record: dict[str, Any] = {"machine": machine(), "code": code_state(), "args": vars(args) | {"json": str(json_path)},
                              "targets": {"featurize_vs_dsyrk_min": TARGET_FEATURIZE,
                                          "certify_fit_vs_cholesky_max": TARGET_CHOL,
                                          "dfa_speedup_min": TARGET_SPEEDUP,
                                          "rss_bound": "3 psi^2 * 8 bytes + 300 MiB"}}
    failures: list[str] = []
    dense: list[dict[str, Any]] = []
    if not args.no_dense:
        with tempfile.TemporaryDirectory(dir=OUT, prefix="large_work_") as tmp:
            for d in dims:
                try:
                    dense.append(dense_point(d, N, args.seq_len, args.bare_repeat, Path(tmp)))
                except Exception as e:  # a measurement: report and go on
                    print(f"  d = {d} failed: {e}", flush=True)
                    failures.append(f"dense d = {d}: {e}")
    record["dense"] = dense
    dfa: list[dict[str, Any]] = []
    baseline: dict[str, Any] | None = None
    if not args.no_dfa:
        for i, (Q, S, n) in enumerate(points):
            print(f"# DFA Q = {Q}, S = {S}, N = {n}: current code ...", flush=True)
            try:
                r = dfa_point(ROOT, Q, S, n)
            except Exception as e:  # a measurement: report and go on
                print(f"  failed: {e}", flush=True)
                failures.append(f"DFA {Q} {S} {n}: {e}")
                continue
            r["code"] = "current"
            dfa.append(r)
            if i == 0 and args.baseline_ref.lower() != "none":
                print(f"# DFA Q = {Q}, S = {S}, N = {n}: baseline {args.baseline_ref} (git worktree) ...", flush=True)
                try:
                    with worktree(args.baseline_ref) as (wt, sha):
                        b = dfa_point(wt, Q, S, n)
                    b["code"] = f"{args.baseline_ref} ({sha[:9]})"
                    b["mhla_cli_file"] = f"<worktree of {sha}>/mhla_cli/__init__.py"
                    dfa.append(b)
                    baseline = {"ref": args.baseline_ref, "commit": sha, "point": [Q, S, n], **compare(r, b)}
                except (subprocess.CalledProcessError, RuntimeError) as e:
                    msg = getattr(e, "stderr", None) or str(e)
                    print(f"  baseline failed: {msg}", flush=True)
                    baseline = {"ref": args.baseline_ref, "point": [Q, S, n], "error": str(msg)}
    record["dfa"] = dfa
    record["baseline"] = baseline

    print(f"\n## bench_large (issue 15, large psi){' --quick' if args.quick else ''}\n")
    print(record["machine"] + "\n")
    code = record["code"]
    print(f"Code under test: the working tree at {code['head'][:9]}"
          + (f" with uncommitted changes ({', '.join(x.split()[-1] for x in code['uncommitted'])})"
             if code["uncommitted"] else "") + ".\n")
    if dense:
        print(f"## 1. Dense teachers: N = {N} sequences of {args.seq_len} float32 Gaussian tokens, a random "
              "d^2-head teacher; each step a fresh `mhla` process (default BLAS threads)\n")
        print(dense_tables(dense))
        short = [f"d = {r['d']} (psi {r['psi']} > N {r['N']})" for r in dense if r["psi"] > r["N"]]
        print(f"\nfeaturize GFLOP/s = N psi (psi+1) / process wall time; dsyrk: scipy float64 syrk of the "
              f"featurize's chunk block (rows x psi), best of {args.bare_repeat} after a warm-up; Cholesky: "
              f"scipy cho_factor (lower) of a random SPD psi x psi float64 matrix, best of {args.bare_repeat}; "
              "certify / fit are whole-process wall times (start-up, load, factorization, writing). "
              "Each bare call runs in its own fresh process."
              + (f" N < psi at {', '.join(short)}: not identifiable there (certify exits 1), so certify and "
                 "fit need eigenvectors, not only a Cholesky." if short else ""))
    if dense and args.quick:
        print("\n--quick checks the script: at these small psi, process start-up and N = 2000 dominate the "
              "ratios, which say nothing about the targets (run the full sizes for those).")
    if dfa:
        print(f"\n## 2. DFA executor points (experiments/dfa_executor.py run_point, 1 BLAS thread, L = {DFA_L}, "
              f"{DFA_N_TEST} held-out DFAs with words of {4 * DFA_L}, seed {DFA_SEED}; each a fresh process)\n")
        print(table(DFA_HEADER, dfa_rows(dfa)))
    if baseline is not None:
        print(f"\n### baseline {baseline['ref']} vs current code, Q = {baseline['point'][0]}, "
              f"S = {baseline['point'][1]}, N = {baseline['point'][2]} (back to back)\n")
        if "error" in baseline:
            print(f"baseline could not be measured: {baseline['error']}")
        else:
            cur = next(r for r in dfa if r["code"] == "current")
            base = next(r for r in dfa if r["code"] != "current")
            steps = list(cur["seconds"])
            print(table(["", *[f"{k} s" for k in steps], "run_point s (end to end)"],
                        [[base["code"], *[base["seconds"][k] for k in steps], base["run_point_seconds"]],
                         ["current", *[cur["seconds"][k] for k in steps], cur["run_point_seconds"]],
                         ["speedup (baseline / current)", *[baseline["step_speedup"][k] for k in steps],
                          baseline["speedup"]]]))
            print()
            print(table(["end-to-end speedup", "target >= 10x", "same verdicts", "same errors",
                         "held-out max err (current / baseline)"],
                        [[f"{baseline['speedup']:.2f}x", verdict(baseline["speedup"] >= TARGET_SPEEDUP),
                          "yes" if baseline["same_verdicts"] else "NO", "yes" if baseline["same_errors"] else "NO",
                          f"{baseline['max_errors']['heldout'][0]:.3g} / {baseline['max_errors']['heldout'][1]:.3g}"]]))
            if not baseline["same_verdicts"]:
                print(f"\nverdicts differ: current {baseline['verdicts_current']}, "
                      f"baseline {baseline['verdicts_baseline']}")
    record["failures"] = failures
    if failures:
        print("\nFailed measurements:\n" + "\n".join(f"- {f}" for f in failures))
    with open(json_path, "w") as fh:
        json.dump(record, fh, indent=1, default=lambda o: o.item() if hasattr(o, "item") else str(o))
    print(f"\nwrote {json_path}")


if __name__ == "__main__":
    main()
