"""Shared helpers for the experiment scripts: paths, tables, timing, in-memory statistics."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python experiments/X.py` puts experiments/ first, not the repo root
    sys.path.insert(0, str(ROOT))

OUT = ROOT / "experiments" / "out"

from mhla_cli.statistics.features import Features  # noqa: E402
from mhla_cli.statistics.accumulate import chunk_features  # noqa: E402
from mhla_cli.model.synthetic import Dataset  # noqa: E402


def out_dir() -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    return OUT


def limit_threads(n: int = 1) -> None:
    """One BLAS / torch thread: the problems are tiny and the machine is shared."""
    try:
        from threadpoolctl import threadpool_limits

        threadpool_limits(n)
    except ImportError:  # pragma: no cover
        pass
    try:
        import torch

        torch.set_num_threads(n)
    except ImportError:
        pass


def features_of(ds: Dataset, lo: int = 0, hi: int | None = None) -> Features:
    """Sufficient statistics of samples [lo, hi) of an in-memory float64 Dataset (what featurize computes)."""
    hi = ds.n_samples if hi is None else hi
    a, b = int(ds.offsets[lo]), int(ds.offsets[hi])
    feats = chunk_features(ds.tokens[a:b], ds.offsets[lo:hi + 1] - a, ds.targets[lo:hi], ds.tokens.shape[1])
    return feats


def subset(ds: Dataset, lo: int, hi: int) -> Dataset:
    """Samples [lo, hi) of a Dataset."""
    a, b = int(ds.offsets[lo]), int(ds.offsets[hi])
    return Dataset(ds.tokens[a:b], ds.offsets[lo:hi + 1] - a, ds.targets[lo:hi])


def fmt(x: float | int | None, digits: int = 2) -> str:
    """Compact number for tables: 1.2e-08, 350, or an em dash for None."""
    if x is None:
        return "—"
    if isinstance(x, (int, np.integer)):
        return str(int(x))
    if not np.isfinite(x):
        return str(x)
    if x == 0:
        return "0"
    if 1e-2 <= abs(x) < 1e4:
        return f"{x:.{digits + 1}g}"
    return f"{x:.{digits - 1}e}"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    for r in rows:
        lines.append("| " + " | ".join(str(c) for c in r) + " |")
    return "\n".join(lines)


class Timer:
    def __enter__(self) -> Timer:
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.t0


DOC_IMAGES = ROOT / "docs" / "img"
_DOC_IMAGE = {"on": False}


def add_doc_image_flag(ap) -> None:
    """--doc-image: also write the figure's small copy that the docs show (docs/img/<name>.png)."""
    ap.add_argument("--doc-image", action="store_true",
                    help="also write the small PNG the docs show, docs/img/<figure>.png (< 100 KB)")


def doc_images(on: bool) -> None:
    _DOC_IMAGE["on"] = bool(on)


def savefig(fig, name: str) -> Path:
    path = out_dir() / name
    fig.savefig(path, dpi=110, bbox_inches="tight")
    if _DOC_IMAGE["on"]:  # the docs' copy: the quick and the full run give the same file name
        DOC_IMAGES.mkdir(parents=True, exist_ok=True)
        fig.savefig(DOC_IMAGES / name.replace("_quick", ""), dpi=60, bbox_inches="tight")
    return path


def env_note() -> str:
    return f"{os.cpu_count()} CPU(s) visible, 1 thread per run, numpy {np.__version__}"


def write_json(path: str | os.PathLike, obj: object) -> None:
    """Write raw results as JSON (numpy scalars as Python numbers, anything else as its str)."""
    import json

    with open(path, "w") as fh:
        json.dump(obj, fh, default=lambda o: o.item() if isinstance(o, np.generic) else str(o))
