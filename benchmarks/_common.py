"""Shared helpers of the benchmark scripts: machine description, data files, timing, tables."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import h5py
import numpy as np

OUT = Path(__file__).resolve().parent / "out"


def machine() -> str:
    """One markdown paragraph: CPU model, cores, load, BLAS (threadpoolctl), versions."""
    from threadpoolctl import threadpool_info

    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    blas = [f"{i['internal_api']} {i['version']} ({i.get('architecture', '?')}, {i['num_threads']} threads, "
            f"{Path(i['filepath']).name})" for i in threadpool_info() if i["user_api"] == "blas"]
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    return (f"Machine: {cpu}, {os.cpu_count()} logical cores, load average {load[0]:.2f} "
            f"(shared machine: other jobs may be running); Python {platform.python_version()}, "
            f"numpy {np.__version__}, h5py {h5py.__version__}; "
            f"BLAS libraries loaded (threadpoolctl): {'; '.join(blas) or '?'}")


def tokens_file(N: int, n: int, d: int, dtype: str = "float32", seed: int = 0, targets: bool = True,
                name: str | None = None) -> Path:
    """An uncompressed dense tokens file (N, n, d) of Gaussian tokens under benchmarks/out (cached).

    Targets are Gaussian noise (the benchmarks time the statistics, not the fit quality); written in
    blocks so that memory stays small for any N.
    """
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / (name or f"tokens_N{N}_n{n}_d{d}_{dtype}_s{seed}.h5")
    if path.exists():
        try:
            with h5py.File(path, "r") as f:
                if f["tokens"].shape == (N, n, d) and ("targets" in f) == targets:
                    return path
        except (OSError, KeyError):
            pass
    tmp = path.with_suffix(".tmp")
    rng = np.random.default_rng(seed)
    block = max(1, (1 << 24) // (n * d))
    with h5py.File(tmp, "w") as f:
        tok = f.create_dataset("tokens", (N, n, d), dtype=dtype)
        tg = f.create_dataset("targets", (N, d), dtype="float64") if targets else None
        for a in range(0, N, block):
            b = min(N, a + block)
            tok[a:b] = rng.standard_normal((b - a, n, d), dtype=np.float32 if dtype == "float32" else np.float64)
            if tg is not None:
                tg[a:b] = rng.standard_normal((b - a, d))
    os.replace(tmp, path)
    return path


def best_of(fn: Callable[[], object], repeat: int = 3) -> float:
    """Minimum wall time of `repeat` calls (the least disturbed by other jobs on a shared machine)."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def run_timed(cmd: list[str], repeat: int = 1, env: dict | None = None) -> float:
    """Best wall time of a subprocess (the whole process: start-up, reading, writing)."""
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        best = min(best, time.perf_counter() - t)
    return best


def mhla_cmd(*args: str) -> list[str]:
    """The `mhla` console script run by this interpreter."""
    return [sys.executable, "-c", "import sys; from mhla_cli.cli import main; sys.argv[0] = 'mhla'; main()",
            *args]


def table(headers: list[str], rows: list[list[object]]) -> str:
    """A markdown table."""
    def cell(x: object) -> str:
        if isinstance(x, float):
            return f"{x:.3g}"
        return str(x)
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    lines += ["| " + " | ".join(cell(x) for x in r) + " |" for r in rows]
    return "\n".join(lines)


def drop_cache_note() -> str:
    return ("Files are read from the page cache after a first warm-up run (the OS cache is not dropped: "
            "that needs root); both sides of each ratio read the same cached file.")
