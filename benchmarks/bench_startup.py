"""Start-up: the wall time of `mhla --version`, `mhla certify --help` and `import mhla_cli`, best of
--repeat runs each, next to a bare `python -c pass` on the same machine (the interpreter's own start).

Targets (issue 26): `mhla --version` <= 0.25 s, `mhla certify --help` <= 0.4 s (idle machine); the
`minus python` column is what mhla adds to the interpreter. Run: python benchmarks/bench_startup.py
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _common import machine, mhla_cmd, table  # noqa: E402


def best_wall(cmd: list[str], repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t = time.perf_counter()
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    print(machine())
    os.environ.setdefault("COLUMNS", "100")
    base = best_wall([sys.executable, "-c", "pass"], args.repeat)
    rows = [["python -c pass", f"{base:.3f}", "0"]]
    for name, cmd in (("mhla --version", mhla_cmd("--version")),
                      ("mhla certify --help", mhla_cmd("certify", "--help")),
                      ("python -c 'import mhla_cli'", [sys.executable, "-c", "import mhla_cli"])):
        t = best_wall(cmd, args.repeat)
        rows.append([name, f"{t:.3f}", f"{t - base:.3f}"])
    print(f"best of {args.repeat}, seconds:")
    print(table(["command", "wall (s)", "minus python (s)"], rows))


if __name__ == "__main__":
    main()
