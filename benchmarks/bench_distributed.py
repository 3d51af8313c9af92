"""The Gram tiled on a Dask cluster (mhla_cli.solve.cluster): the blocked Cholesky against
dask.array.linalg.cholesky, the cluster against one machine at d = 32, the largest d this machine
finishes, and a cost model fitted to the measured tile rates.

Four parts, each printing markdown tables and writing benchmarks/out/bench_distributed_<part>.json:

  cholesky  A random symmetric positive definite matrix of n = --n (8192) in tiles of --tile (1024), made
            on the workers of a LocalCluster (one single-threaded worker process per core): mhla's blocked
            Cholesky (mhla_cli.linalg.tiled_matrix: potrf / trsm / syrk-gemm tasks on the lower tiles)
            and dask.array.linalg.cholesky of the same matrix (as a dask array whose upper tiles are the
            transposes of the lower ones), each timed twice; wall time, tasks, each worker's peak RSS
            (VmHWM, reset before each run) and the factor's largest agreement error.
  ratio     d = --d (32) on that LocalCluster against the single-machine path, in this process: the
            library's featurize + certify, and featurize + fit (what `mhla certify` / `mhla fit` run),
            against `certify` / `fit` with the scheduler (the tiles accumulated on the workers, the
            Cholesky over them, the solves). N = --N Gaussian sequences of --seq-len float32 tokens,
            targets from a random 2-head teacher. Ratio cluster / one machine (goal <= 2), the verdicts,
            lambda_min and coef compared, each worker's peak RSS and this process's (the client's: it
            holds the psi x d moments and the Lanczos basis, never a tile).
  largest   --d (42) on a LocalCluster whose workers have --memory-limit (4 GiB) each and spill to disk:
            the tiles accumulated once, certify and fit on them (the library: the fit reuses the
            certificate's factor), wall time and each worker's peak RSS; the per-kind task times (dask's
            task stream) for the cost model. --N defaults to 1.1 psi.
  model     The cost model (tiles, flops, bytes moved, tasks) with the rates measured by `largest` (or
            `ratio`) here, its check against the measured wall time, and its prediction for --predict-d
            (64) on --machines (16) machines of --cores (32) cores with --bandwidth (1.25 GB/s) each:
            a prediction, not a measurement.

Run the long parts with `nice`, alone on the machine: python benchmarks/bench_distributed.py ratio
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
import warnings
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from _common import OUT, machine, table  # noqa: E402

from mhla_cli.feature_map import n_features  # noqa: E402
from mhla_cli.linalg.tiled_matrix import TiledMatrix  # noqa: E402


# ------------------------------------------------------------------------------------ helpers


def cholesky_task_count(nb: int) -> dict[str, int]:
    """Tasks of the blocked Cholesky of nb tile rows: potrf, trsm and the trailing updates."""
    return {"potrf": nb, "trsm": nb * (nb - 1) // 2, "update": sum((nb - k - 1) * (nb - k) // 2 for k in range(nb))}


def library_cholesky(matrix: TiledMatrix, shift: float = 0.0) -> tuple[Any, int]:
    """The baseline: dask.array.linalg.cholesky of the matrix - shift I, the symmetric matrix as a dask array
    (upper tiles the transposes of the lower ones), the lower factor persisted; (its futures by tile, the
    graph's task count)."""
    import itertools
    import uuid

    import dask.array as da
    from dask.highlevelgraph import HighLevelGraph
    from distributed import futures_of, wait

    name = f"mhla-symmetric-{uuid.uuid4().hex}"
    nb, sizes = matrix.nb, matrix.sizes
    dsk: dict[Any, Any] = {}
    for i, j in itertools.product(range(nb), repeat=2):
        dsk[name, i, j] = matrix.tiles[i, j] if i >= j else (np.transpose, matrix.tiles[j, i])
    a = da.Array(HighLevelGraph.from_collections(name, dsk, dependencies=[]), name,
                 chunks=(tuple(sizes), tuple(sizes)), dtype=np.float64)
    if shift:
        a = a - shift * da.eye(matrix.n, chunks=sizes[0], dtype=np.float64)
    lower = da.linalg.cholesky(a, lower=True)
    tasks = len(dict(lower.__dask_graph__()))
    lower = matrix.client.persist(lower)
    wait(lower)
    futures = futures_of(lower)
    return {(int(f.key[1]), int(f.key[2])): f for f in futures if int(f.key[1]) >= int(f.key[2])}, tasks


def cluster(workers: int, memory_limit: str | None = None) -> tuple[Any, Any]:
    from dask.distributed import Client, LocalCluster

    warnings.simplefilter("ignore")
    kw = {} if memory_limit is None else {"memory_limit": memory_limit}
    cl = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True, dashboard_address=None,
                      silence_logs=logging.ERROR, **kw)
    return cl, Client(cl)


def _reset_peak() -> bool:
    """Reset this process's VmHWM (Linux: clear_refs 5); whether it could."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _peak() -> float:
    """This process's peak RSS (VmHWM) in MiB."""
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def worker_peaks(client: Any) -> list[float]:
    return sorted(client.run(_peak).values())


def reset_peaks(client: Any) -> None:
    client.run(_reset_peak)
    _reset_peak()


def task_times(stream: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Compute seconds and task counts per kind (the key's mhla-<kind>- prefix) of a dask task stream."""
    out: dict[str, dict[str, float]] = {}
    for t in stream:
        key = t["key"] if isinstance(t["key"], str) else str(t["key"])
        parts = key.split("-")
        kind = parts[1] if parts[0] == "mhla" and len(parts) > 2 else parts[0]
        if kind == "tile":
            kind = "tile-" + parts[2] if parts[2] in ("sum", "final", "finite") else "tile"
        secs = sum(s["stop"] - s["start"] for s in t.get("startstops", ()) if s.get("action") == "compute")
        rec = out.setdefault(kind, {"seconds": 0.0, "tasks": 0})
        rec["seconds"] += secs
        rec["tasks"] += 1
    return out


def save(part: str, rec: dict[str, Any]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"bench_distributed_{part}.json").write_text(json.dumps(rec, indent=1, default=float))


# ------------------------------------------------------------------------------------ cholesky


def _spd_tile(i: int, j: int, ts: int, n: int, seed: int) -> np.ndarray:
    """Tile (i, j) of R + R^T + n I with R random in [0, 1): symmetric, diagonally dominant (PD)."""
    r = np.random.default_rng([seed, i, j]).random((ts, ts))
    if i != j:
        return r + np.random.default_rng([seed, j, i]).random((ts, ts)).T
    return r + r.T + n * np.eye(ts)


def bench_cholesky(args: argparse.Namespace) -> None:
    n, ts = args.n, args.tile
    nb = n // ts
    cl, client = cluster(args.workers)
    rows = []
    rec: dict[str, Any] = {"n": n, "tile": ts, "workers": args.workers, "machine": machine()}
    try:
        tiles = {(i, j): client.submit(_spd_tile, i, j, ts, n, 0, pure=False) for i in range(nb) for j in range(i + 1)}
        m = TiledMatrix(client, tiles, [ts] * nb)
        client.gather(list(tiles.values()))
        mine_f = lib_f = None
        for rep in range(2):
            reset_peaks(client)
            t = time.perf_counter()
            mine_f = m.cholesky(0.0)
            mine_t = time.perf_counter() - t
            mine_peak = worker_peaks(client)
            tasks_mine = sum(cholesky_task_count(nb).values())
            if rep == 0:
                mine_f.release()
            reset_peaks(client)
            t = time.perf_counter()
            lib_f, tasks_lib = library_cholesky(m, 0.0)
            lib_t = time.perf_counter() - t
            lib_peak = worker_peaks(client)
            if rep == 0:
                for f in lib_f.values():
                    f.release()
            rows.append(["mhla blocked (lower tiles)", rep + 1, mine_t, tasks_mine, max(mine_peak)])
            rows.append(["dask.array.linalg.cholesky", rep + 1, lib_t, tasks_lib, max(lib_peak)])
            rec.setdefault("runs", []).append({"mine_seconds": mine_t, "library_seconds": lib_t,
                                               "mine_tasks": tasks_mine, "library_tasks": tasks_lib,
                                               "mine_worker_peak_mib": mine_peak, "library_worker_peak_mib": lib_peak})
        err = 0.0
        for (i, j), f in list(mine_f.tiles.items())[:6]:
            a, b = f.result(), lib_f[i, j].result()
            err = max(err, float(np.abs((np.tril(a) if i == j else a) - b).max() / np.abs(b).max()))
        rec["factor_agreement"] = err
    finally:
        client.close()
        cl.close()
    print(f"## Blocked Cholesky on a LocalCluster: n = {n}, tiles of {ts} ({nb} x {nb}), {args.workers} workers\n")
    print(table(["algorithm", "run", "seconds", "tasks", "largest worker peak RSS (MiB)"], rows))
    best_mine = min(r["mine_seconds"] for r in rec["runs"])
    best_lib = min(r["library_seconds"] for r in rec["runs"])
    print(f"\nbest of 2: mhla {best_mine:.2f} s, dask.array.linalg.cholesky {best_lib:.2f} s "
          f"(ratio {best_lib / best_mine:.2f}); the factors agree to {err:.1e} (relative, first tiles)\n")
    print(machine())
    save("cholesky", rec)


# ------------------------------------------------------------------------------------ d = 32: cluster vs one machine


def data(d: int, N: int, seq_len: int) -> str:
    from mhla_cli.model import synthetic

    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"distributed_d{d}_N{N}_n{seq_len}.h5"
    if not path.exists():
        ds, _ = synthetic.generate_teacher(d, 2, N, seq_len, seed=0, dtype="float32")
        ds.save(path, dtype="float32", compression=None)
    return str(path)


def on_cluster(path: str, client: Any, tile: int | None) -> dict[str, Any]:
    """certify and fit with the scheduler, as the CLI runs them (one accumulation each)."""
    from distributed import get_task_stream

    from mhla_cli.solve import cluster as cluster_mod
    from mhla_cli import certify

    out: dict[str, Any] = {}
    reset_peaks(client)
    with get_task_stream(client) as ts:
        t = time.perf_counter()
        with cluster_mod.open_statistics(path, client, tile_features=tile) as stats:
            out["accumulate_seconds"] = time.perf_counter() - t
            cert = certify(stats)
        out["certify_seconds"] = time.perf_counter() - t
        out["certify_worker_peak_mib"] = worker_peaks(client)
        t = time.perf_counter()
        model = cluster_mod.fit(path, client, tile_features=tile)
        out["fit_seconds"] = time.perf_counter() - t
    out["worker_peak_mib"] = worker_peaks(client)
    out["client_peak_mib"] = _peak()
    out["task_times"] = task_times(ts.data)
    out.update(identifiable=cert.identifiable, lambda_min=cert.lambda_min, lambda_max=cert.lambda_max,
               certify_seconds_parts=cert.seconds, tasks=cert.tasks, tile=stats.tile, nb=stats.matrix.nb,
               coef=model.coef)
    return out


def on_one_machine(path: str) -> dict[str, Any]:
    from mhla_cli import certify, featurize, fit

    out: dict[str, Any] = {}
    t = time.perf_counter()
    cert = certify(featurize(path))
    out["certify_seconds"] = time.perf_counter() - t
    t = time.perf_counter()
    model = fit(featurize(path))
    out["fit_seconds"] = time.perf_counter() - t
    out.update(identifiable=cert.identifiable, lambda_min=cert.lambda_min, coef=model.coef,
               peak_mib=_peak())
    return out


def bench_ratio(args: argparse.Namespace) -> None:
    d = args.d
    psi = n_features(d)
    N = args.N or int(1.2 * psi)
    path = data(d, N, args.seq_len)
    cl, client = cluster(args.workers)
    try:
        _reset_peak()
        c = on_cluster(path, client, args.tile)
    finally:
        client.close()
        cl.close()
    _reset_peak()
    one = on_one_machine(path)
    rel_l = abs(c["lambda_min"] - one["lambda_min"]) / one["lambda_min"]
    rel_c = float(np.abs(c["coef"] - one["coef"]).max() / np.abs(one["coef"]).max())
    rows = [["certify", one["certify_seconds"], c["certify_seconds"], c["certify_seconds"] / one["certify_seconds"]],
            ["fit", one["fit_seconds"], c["fit_seconds"], c["fit_seconds"] / one["fit_seconds"]]]
    print(f"## d = {d} (psi = {psi}), N = {N} sequences of {args.seq_len} tokens: a LocalCluster of {args.workers} "
          f"workers against one machine\n")
    print(table(["command", "one machine (s)", "cluster (s)", "ratio cluster / one machine"], rows))
    print(f"\nverdicts {one['identifiable']} / {c['identifiable']}; lambda_min {one['lambda_min']:.6g} / "
          f"{c['lambda_min']:.6g} (relative difference {rel_l:.1e}); coef relative difference {rel_c:.1e}")
    print(f"tiles of {c['tile']} features ({c['nb']} x {c['nb']}); accumulation {c['accumulate_seconds']:.1f} s; "
          f"tasks {c['tasks']}")
    print(f"peak RSS: workers {', '.join(f'{x:.0f}' for x in c['worker_peak_mib'])} MiB; client (this process, "
          f"cluster part) {c['client_peak_mib']:.0f} MiB; one machine {one['peak_mib']:.0f} MiB; the Gram "
          f"{8 * psi * psi / 2**20:.0f} MiB\n")
    print(machine())
    save("ratio", {"d": d, "N": N, "cluster": {k: v for k, v in c.items() if k != "coef"},
                   "one_machine": {k: v for k, v in one.items() if k != "coef"},
                   "lambda_min_rel": rel_l, "coef_rel": rel_c, "machine": machine()})


# ------------------------------------------------------------------------------------ the largest d here


def once_on_cluster(path: str, client: Any, tile: int | None) -> dict[str, Any]:
    """One accumulation, then certify and fit on it (the library: the fit reuses the certificate's factor)."""
    from distributed import get_task_stream

    from mhla_cli.solve import cluster as cluster_mod
    from mhla_cli import certify
    from mhla_cli.statistics.distributed import tiled_statistics

    out: dict[str, Any] = {}
    reset_peaks(client)
    with get_task_stream(client) as ts:
        t = time.perf_counter()
        stats = tiled_statistics.accumulate(path, client, tile_features=tile)
        out["accumulate_seconds"] = time.perf_counter() - t
        t = time.perf_counter()
        cert = certify(stats)
        out["certify_seconds"] = time.perf_counter() - t
        t = time.perf_counter()
        model = cluster_mod.fit(stats)
        out["fit_seconds"] = time.perf_counter() - t
        stats.release()
    out["worker_peak_mib"] = worker_peaks(client)
    out["client_peak_mib"] = _peak()
    out["task_times"] = task_times(ts.data)
    out.update(identifiable=cert.identifiable, lambda_min=cert.lambda_min, lambda_max=cert.lambda_max,
               seconds=cert.seconds, estimates=cert.estimates, tasks=cert.tasks, tile=stats.tile,
               nb=stats.matrix.nb, train_mse=model.info["train_mse"])
    return out


def bench_largest(args: argparse.Namespace) -> None:
    d = args.d
    psi = n_features(d)
    N = args.N or int(1.1 * psi)
    path = data(d, N, args.seq_len)
    cl, client = cluster(args.workers, args.memory_limit)
    t0 = time.perf_counter()
    try:
        _reset_peak()
        c = once_on_cluster(path, client, args.tile)
    finally:
        client.close()
        cl.close()
    wall = time.perf_counter() - t0
    print(f"## d = {d} (psi = {psi}, the Gram {8 * psi * psi / 2**30:.1f} GiB), N = {N}: a LocalCluster of "
          f"{args.workers} workers with {args.memory_limit} each, spilling to disk\n")
    rows = [["accumulation of the tiles (one pass)", c["accumulate_seconds"]],
            ["certify (Lanczos for lambda_max, the Cholesky, Lanczos for lambda_min)", c["certify_seconds"]],
            ["fit (the triangular solves with the certificate's factor)", c["fit_seconds"]],
            ["all, with the cluster's start and the data's check", wall]]
    print(table(["step", "seconds"], rows))
    lanczos = ", ".join(f"{k} {v['products']} products, converged {v['converged']}" for k, v in c["estimates"].items())
    print(f"\nverdict {c['identifiable']}, lambda_min ~ {c['lambda_min']:.6g}, lambda_max ~ {c['lambda_max']:.6g} "
          f"(Lanczos: {lanczos}); tiles of {c['tile']} ({c['nb']} x {c['nb']}); tasks {c['tasks']}; "
          f"seconds {c['seconds']}")
    print(f"peak RSS: workers {', '.join(f'{x:.0f}' for x in c['worker_peak_mib'])} MiB; client "
          f"{c['client_peak_mib']:.0f} MiB\n")
    print(table(["task kind", "tasks", "compute seconds"],
                [[k, int(v["tasks"]), v["seconds"]] for k, v in sorted(c["task_times"].items())]))
    print()
    print(machine())
    save("largest", {"d": d, "N": N, "memory_limit": args.memory_limit, "workers": args.workers, "wall": wall,
                     "cluster": {k: v for k, v in c.items() if k != "coef"}, "machine": machine()})


# ------------------------------------------------------------------------------------ the cost model


def costs(d: int, N: int, tile: int) -> dict[str, float]:
    """Flops, tasks and bytes of certify + fit at d with tiles of `tile` features (mhla_cli.solve.cluster)."""
    q = d * (d + 1) // 2
    psi = q * d
    k = tile // d
    nb = max(1, q // k)
    ts = psi / nb
    pairs = nb * (nb - 1) / 2 * k * k + nb * k * (k + 1) / 2  # (a, b) pairs of the lower tiles
    acc = 2.0 * N * pairs * d * (d + 1) / 2  # the GEMMs K += U^T V
    chol = {"potrf": nb * ts**3 / 3, "trsm": nb * (nb - 1) / 2 * ts**3,
            "update": sum((nb - j - 1) * (nb - j) / 2 for j in range(nb)) * 2 * ts**3}
    tasks = cholesky_task_count(nb)
    tile_bytes = 8 * ts * ts
    return {"psi": psi, "nb": nb, "ts": ts, "acc_flops": acc, "chol_flops": sum(chol.values()),
            "tiles": nb * (nb + 1) / 2, "tasks_chol": sum(tasks.values()), "tile_bytes": tile_bytes,
            # every update reads two factor tiles, every trsm one: the bytes a Cholesky moves at most
            "chol_bytes": (2 * tasks["update"] + tasks["trsm"]) * tile_bytes,
            "read_bytes": nb * (nb + 1) / 2 * N * 16 * d * 4,  # every tile task reads the tokens (16 a sequence)
            "critical_path": nb}


def bench_model(args: argparse.Namespace) -> None:
    src = OUT / f"bench_distributed_{args.source}.json"
    rec = json.loads(src.read_text())
    c = rec["cluster"]
    d, N = rec["d"], rec["N"]
    times = c["task_times"]
    m = costs(d, N, c["tile"])
    # the measured rates (flops per compute second of each kind of task, on one core)
    acc_kinds = [k for k in times if k.startswith("tile") or k == "moments"]
    chol_kinds = ["potrf", "trsm", "update"]
    lanczos_kinds = ["block", "product", "product-sum", "solve"]  # the products and solves of Lanczos and the fit
    acc_s = sum(times[k]["seconds"] for k in acc_kinds)
    chol_s = sum(times.get(k, {"seconds": 0.0})["seconds"] for k in chol_kinds)
    other_s = sum(times.get(k, {"seconds": 0.0})["seconds"] for k in lanczos_kinds)
    basis_s = sum(v["seconds"] for k, v in times.items() if k in ("accumulate_range", "add"))  # the basis passes
    r_acc, r_chol = m["acc_flops"] / acc_s, m["chol_flops"] / chol_s
    n_other = sum(times.get(k, {"tasks": 0})["tasks"] for k in lanczos_kinds)
    r_basis = N * args.seq_len * d / max(basis_s, 1e-9)  # token entries read and summed per second, per core
    workers = rec.get("workers", 2)
    # one accumulation and one Cholesky (`largest`: the fit reuses the certificate's factor)
    model_here = (m["acc_flops"] / r_acc + m["chol_flops"] / r_chol + other_s + basis_s) / workers
    measured = c["accumulate_seconds"] + c["certify_seconds"] + c["fit_seconds"]
    print(f"## The cost model, fitted at d = {d} (psi = {m['psi']}), N = {N}, tiles of {c['tile']}\n")
    print(table(["kind", "tasks", "compute seconds", "flops", "GFLOP/s per core"],
                [["accumulation (K GEMMs)", sum(v["tasks"] for k, v in times.items() if k.startswith("tile")), acc_s,
                  m["acc_flops"], r_acc / 1e9],
                 ["Cholesky (potrf, trsm, updates)", sum(times.get(k, {"tasks": 0})["tasks"] for k in ("potrf", "trsm", "update")),
                  chol_s, m["chol_flops"], r_chol / 1e9],
                 ["products and solves (Lanczos, the fit)", n_other, other_s, float("nan"), float("nan")],
                 ["the basis passes (d x d sums)", sum(v["tasks"] for k, v in times.items() if k in ("accumulate_range", "add")),
                  basis_s, float("nan"), float("nan")]]))
    print(f"\nmodel here: {model_here:.0f} s of compute over {workers} workers against {measured:.0f} s measured "
          f"(accumulation, certify and fit; the rest is the scheduler, transfers and spilling)\n")
    # the per-task times: the scheduler's own (no-op tasks on a fresh LocalCluster here) and the workers'
    # beside the compute (transfers, (de)serialisation, waiting), from the Lanczos and solve phase's wall time
    t_s = scheduler_time(workers)
    lanczos_tasks = sum(c["tasks"].get(k, 0) for k in lanczos_kinds)
    lanczos_wall = c["certify_seconds"] - c["seconds"].get("cholesky", 0.0) + c["fit_seconds"]
    t_w = max(0.0, (lanczos_wall * workers - other_s) / max(lanczos_tasks, 1))
    products = sum(v["products"] for v in c["estimates"].values())
    print(f"per task: the scheduler {t_s * 1e3:.2f} ms (no-op tasks), the workers beside the compute {t_w * 1e3:.1f} ms "
          f"({lanczos_tasks} tasks of the Lanczos products and solves, {products} products)\n")
    rates = {"acc": r_acc, "chol": r_chol, "t_s": t_s, "t_w": t_w, "basis": r_basis, "products": products,
             "lanczos_tasks": lanczos_tasks, "lanczos_compute": other_s, "nb": c["nb"], "seq_len": args.seq_len,
             "ts_here": m["ts"]}
    # the model's check: this machine's run itself, and the next d here
    here = []
    for D in sorted({d, *args.here}):
        q = predict(D, 1, workers, float("inf"), rates)
        here.append([D, q["psi"], f"{8 * q['psi'] ** 2 / 2**30:.1f}", q["parts"]["accumulation"], q["parts"]["cholesky"],
                     q["parts"]["lanczos"], q["seconds"] / 60, f"{measured / 60:.1f}" if D == d else "-"])
    print(f"## The model on this machine ({workers} workers; N = 1.1 psi)\n")
    print(table(["d", "psi", "Gram GiB", "accumulation s", "Cholesky s", "Lanczos and solves s", "total min",
                 "measured min"], here))
    D, M, C, bw = args.predict_d, args.machines, args.cores, args.bandwidth
    q = predict(D, M, C, bw, rates)
    pp = q["parts"]
    print(f"\n## Prediction (not a measurement): d = {D} (psi = {q['psi']}, the Gram {8 * q['psi'] ** 2 / 2**30:.0f} GiB), "
          f"N = {q['N']}, on {M} machines of {C} cores, {bw / 1e9:.2f} GB/s each (one Dask scheduler)\n")
    print(table(["part", "model", "seconds"],
                [["accumulation", f"{q['acc_flops']:.3g} flops / ({M * C} cores x {r_acc / 1e9:.1f} GFLOP/s) + "
                  f"{q['tiles']:.0f} tiles x the scheduler", pp["accumulation"]],
                 ["Cholesky", f"{q['chol_flops']:.3g} flops at {r_chol / 1e9:.1f} GFLOP/s a core (or the critical path "
                  f"of {q['nb']} tile rows) + {q['tasks_chol']:.0f} tasks x the scheduler", pp["cholesky"]],
                 ["tiles moved", f"{q['chol_bytes'] / 2**30:.0f} GiB, {(M - 1) / M:.2f} of it between machines", pp["moves"]],
                 ["Lanczos and solves", f"{q['tasks_lanczos']:.0f} tasks x the scheduler, their overhead over the cores, "
                  f"and {products} x 4 x {q['nb']} chained steps", pp["lanczos"]],
                 ["basis passes", f"4 passes over {q['N'] * args.seq_len} tokens", pp["basis"]],
                 ["accumulation, certify and fit", "the sum (one accumulation, one Cholesky)", q["seconds"]]]))
    print(f"\nper worker: a few tiles of {q['tile_bytes'] / 2**20:.0f} MiB at a time, and "
          f"{q['psi'] ** 2 * 8 / (M * C) / 2**20:.0f} MiB of the Gram's lower triangle and its factor held (or spilled)\n")
    save("model", {"fitted_at": {"d": d, "N": N}, "rates": rates, "model_here": model_here, "measured_here": measured,
                   "here": here, "prediction": {"machines": M, "cores": C, "bandwidth": bw, **q}})


def predict(D: int, M: int, C: int, bw: float, r: dict[str, Any]) -> dict[str, Any]:
    """The cost model's seconds for accumulation, certify and fit (one accumulation, one Cholesky) at d = D on M
    machines of C cores with the measured rates `r` (flops a core; the scheduler's and the workers' time a task)."""
    from mhla_cli.statistics.distributed.tiled_statistics import tile_pairs

    Np = int(1.1 * n_features(D))
    p = costs(D, Np, D * tile_pairs(D))
    cores = M * C
    nb = p["nb"]
    acc = p["acc_flops"] / (r["acc"] * cores) + p["tiles"] * r["t_s"]
    step = (p["ts"] ** 3 / 3 + 3 * p["ts"] ** 3) / r["chol"]  # potrf, trsm and an update in a row: the critical path
    chol = max(p["chol_flops"] / (r["chol"] * cores), nb * step) + p["tasks_chol"] * r["t_s"]
    moves = p["chol_bytes"] * (M - 1) / M / (M * bw) if M > 1 else 0.0
    # as many products as measured; a product has nb (nb + 1) / 2 + 2 nb tasks, a lambda_min step two solves of
    # nb^2 tasks each, whose chains are 2 nb steps (a task's overhead and a gemm of a tile by a block each)
    scale = (nb * (nb + 1) / 2 + 2 * nb * nb) / max(1, r["nb"] * (r["nb"] + 1) / 2 + 2 * r["nb"] ** 2)
    tasks_l = r["lanczos_tasks"] * scale
    per_task = r["t_w"] + r["lanczos_compute"] / max(r["lanczos_tasks"], 1) * (p["ts"] / (r.get("ts_here") or p["ts"])) ** 2
    chain = r["products"] * 4 * nb * (r["t_w"] + 2 * p["ts"] * p["ts"] * 8 / r["chol"])
    lanczos = tasks_l * r["t_s"] + tasks_l * per_task / cores + chain
    basis = 4 * Np * r["seq_len"] * D / (r["basis"] * cores) + 4 * 64 * r["t_s"]
    parts = {"accumulation": acc, "cholesky": chol, "moves": moves, "lanczos": lanczos, "basis": basis}
    return {**p, "N": Np, "tasks_lanczos": tasks_l, "parts": parts, "seconds": sum(parts.values())}


def _noop(x: int) -> int:
    return x


def scheduler_time(workers: int, n: int = 4000) -> float:
    """Seconds per task of the scheduler: n no-op tasks submitted at once on a LocalCluster of `workers`."""
    cl, client = cluster(workers)
    try:
        client.gather(client.map(_noop, range(100)))  # warm
        t = time.perf_counter()
        client.gather(client.map(_noop, range(1000, 1000 + n)))
        return (time.perf_counter() - t) / n
    finally:
        client.close()
        cl.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", choices=("cholesky", "ratio", "largest", "model"))
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="LocalCluster workers (one per core)")
    ap.add_argument("--n", type=int, default=8192, help="cholesky: the matrix order")
    ap.add_argument("--tile", type=int, default=None, help="tile side (features; default from tiled_statistics.TILE_BYTES; "
                                                          "cholesky: 1024)")
    ap.add_argument("--d", type=int, default=None, help="ratio: 32; largest: 42")
    ap.add_argument("--N", type=int, default=None, help="sequences (default 1.2 psi, largest 1.1 psi)")
    ap.add_argument("--seq-len", type=int, default=16)
    ap.add_argument("--memory-limit", default="4GiB", help="largest: each worker's memory limit")
    ap.add_argument("--source", default="largest", choices=("largest",), help="model: the run to fit")
    ap.add_argument("--predict-d", type=int, default=64)
    ap.add_argument("--here", type=int, nargs="*", default=[44, 46, 48], help="model: d to predict on this machine")
    ap.add_argument("--machines", type=int, default=16)
    ap.add_argument("--cores", type=int, default=32)
    ap.add_argument("--bandwidth", type=float, default=1.25e9, help="bytes/s per machine (10 Gbit/s)")
    args = ap.parse_args()
    if args.part == "cholesky":
        args.tile = args.tile or 1024
        bench_cholesky(args)
    elif args.part == "ratio":
        args.d = args.d or 32
        bench_ratio(args)
    elif args.part == "largest":
        args.d = args.d or 42
        bench_largest(args)
    else:
        bench_model(args)


if __name__ == "__main__":
    main()
