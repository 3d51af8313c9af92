"""Memory budget: refuse up front a job whose psi x psi matrices cannot fit in memory.

Each command's peak is counted in psi x psi float64 matrices (`matrix_bytes`), the accumulator of a
pass ((psi + d)^2 with targets) and its chunk buffers, plus SLACK_BYTES for the small work arrays
(tiles of the in-place basis changes, read buffers, allocator slack):

- featurize: the accumulator and its chunk buffers during the pass (with K workers: K of each, and
  the sum they are added into); then the accumulator, which becomes the canonical `basis_gram` in
  place, and the own-coordinate `gram` derived from it for the file (written without copies);
- certify / fit of a features file: `basis_gram` (the stored own `gram` is validated tile by tile
  and read only when a consumer needs it) plus what the factorization of Lambda~ holds
  (`SOLVE_COPIES`, of mhla_cli.solve.domains / mhla_cli.linalg.factorization);
- certify / fit of a tokens file: the larger of the pass and the solve;
- loading a features file (`check_load`): `basis_gram` (or the block on the data's spans) and, for a
  compact file, its distinct entries; `mhla merge`: two such sums and their own grams (`merge_bytes`).

Wide tokens (a transformer's hidden states, D = 384..4096) are refused before anything of their size
is allocated, whatever path the job would take (`check_floor`): even the cheapest pass over them, the
partial traces of the data's spans, needs `floor_bytes(d)`; the refusal names the largest d whose
featurize fits this machine and `mhla reduce`, which maps the tokens to that many dimensions. Every
other refusal (`check_memory`) also names `--scheduler`: on a Dask cluster the Gram stays tiled on the
workers (docs/cluster.md).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from . import krylov, symgram
from ..errors import InputError, Refused
from ..feature_map import n_features

# Room for what the counts leave out: small work arrays and read buffers, allocator slack.
SLACK_BYTES = 64 * 2**20
# psi x psi matrices the solve holds besides basis_gram (mhla_cli.solve.domains.factorize / Factorization,
# which holds Lambda~ as basis_gram and the scale 1 / N, no copy):
# "cholesky": the Cholesky factor (an identifiable certificate, a fit);
# "eigh": the eigensolver's copy and its eigenvectors, then the null space (N < psi: certainly
# singular); "ridge": the system (Lambda~ + l I) and its factor; "lowrank": the own gram too.
# With the matrix itself, these copies cover the peak RSS of certify and fit at d = 24 (psi = 7200; less
# the RSS of a bare process), with a little room.
SOLVE_COPIES = {"cholesky": 1.2, "eigh": 3, "fit-eigh": 3.5, "ridge": 2.2, "lowrank": 4}


# q x q float64 matrices (q = psi / d = d (d + 1) / 2) the cheapest pass over d-dim tokens holds:
# the span pass's partial trace, its symmetrised copy and sum (stream.find_spans), and the
# eigensolver's copy and eigenvectors (structure.from_traces).
FLOOR_COPIES = 4


def matrix_bytes(d: int) -> int:
    """Bytes of one psi x psi float64 matrix."""
    return 8 * n_features(d) ** 2


def accumulator_bytes(d: int, has_targets: bool = True) -> int:
    """Bytes of a pass's accumulator: the Gram of [Ht | Y], (psi + d)^2 float64 with targets; when the
    pass accumulates the Gram's distinct entries K instead (mhla_cli.linalg.symgram), at least K and the
    psi x psi Gram expanded from it (an upper bound: the statistics hold K, and a features file's two
    psi x psi datasets are expanded one at a time when written, after the K of the own gram)."""
    w = n_features(d) + (d if has_targets else 0)
    if d < symgram.SYMGRAM_MIN_D:
        return 8 * w * w
    k_rows, k_cols = symgram.pairs_shape(d * (d + 1) // 2, d)
    return max(8 * w * w, 8 * k_rows * k_cols + matrix_bytes(d))


def featurize_bytes(d: int, chunk_bytes: int = 0, workers: int = 1, has_targets: bool = True,
                    derive: bool = True) -> int:
    """Peak of `featurize`: the pass, then (`derive`) the accumulator and the own-coordinate gram."""
    acc = accumulator_bytes(d, has_targets)
    k = max(1, int(workers))
    pass_ = acc + chunk_bytes if k == 1 else (k + 1) * acc + k * chunk_bytes
    return max(pass_, acc + matrix_bytes(d) if derive else 0) + SLACK_BYTES


def block_featurize_bytes(n: int, d: int, chunk_bytes: int = 0, workers: int = 1, has_targets: bool = True) -> int:
    """Peak of `featurize` accumulating only a block of n features (the data's spans,
    mhla_cli.statistics.structure): the pass's accumulator of n (+ d) columns; no own-coordinate gram."""
    w = n + (d if has_targets else 0)
    acc = 8 * w * w
    k = max(1, int(workers))
    return (acc + chunk_bytes if k == 1 else (k + 1) * acc + k * chunk_bytes) + SLACK_BYTES


def load_bytes(d: int) -> int:
    """Peak of loading a features file (basis_gram read in place; gram validated tile by tile)."""
    return matrix_bytes(d) + SLACK_BYTES


def merge_bytes(d: int) -> int:
    """Peak of `mhla merge`: the sum and the part being added, each with basis_gram and the stored own gram."""
    return 4 * matrix_bytes(d) + SLACK_BYTES


def check_load(d: int, block: int | None = None, pairs_bytes: int = 0,
               path: str | os.PathLike | None = None) -> None:
    """Refuse up front loading the statistics of a features file of `d` that cannot fit in memory,
    before anything large is read: `load_bytes(d)`, or for a file that holds only the block on the
    data's spans (`block` features) that n x n block; a compact file also holds its distinct entries
    (`pairs_bytes`) while they are expanded."""
    need: Callable[[int], int] = load_bytes
    if block is not None:  # only the block on the data's spans is stored
        def block_need(k: int) -> int:
            return 8 * block * block + SLACK_BYTES if k == d else load_bytes(k)
        need = block_need
    if pairs_bytes:  # a compact file: its distinct entries are read, then expanded
        base = need

        def pairs_need(k: int) -> int:
            return base(k) + (pairs_bytes if k == d else 0)
        need = pairs_need
    check_memory(d, path=path, need=need, what="loading the statistics")


def solve_bytes(d: int, kind: str = "cholesky") -> int:
    """Peak of certify / fit on loaded statistics: basis_gram and the factorization's matrices (and the
    basis of block Lanczos, krylov.basis_bytes)."""
    return block_solve_bytes(n_features(d), kind)


def block_solve_bytes(n: int, kind: str = "cholesky") -> int:
    """`solve_bytes` of statistics holding only a block of n features (the data's spans)."""
    return int((1 + SOLVE_COPIES[kind]) * 8 * n * n) + krylov.basis_bytes(n) + SLACK_BYTES


def solve_kind(d: int, n_samples: int, ridge: float = 0.0, lowrank: bool = False, command: str = "certify",
               n: int | None = None) -> str:
    """Which solve a job will run, as far as is known before the work (N < n features: singular for
    sure); `n` the features factorized (default psi)."""
    if lowrank:
        return "lowrank"
    if ridge > 0:
        return "ridge"
    if n_samples >= (n_features(d) if n is None else n):
        return "cholesky"
    return "fit-eigh" if command == "fit" else "eigh"


def solve_need_of(d: int, n_samples: int, ridge: float = 0.0, lowrank: bool = False, command: str = "certify",
                  block: int | None = None, pass_need: Callable[[int], int] | None = None) -> Callable[[int], int]:
    """need(k): the peak bytes of certifying / fitting (`command`) statistics of n_samples samples with
    their dimension set to k (for `check_memory`). `block`: at the statistics' own d only that block of
    features is factorized (the data's spans; not for a low-rank fit); `pass_need`: the pass of a tokens
    file featurized first (the peak is the larger of the two)."""
    def solve(k: int) -> int:
        return solve_bytes(k, solve_kind(k, n_samples, ridge, lowrank, command))
    if block is not None and not lowrank:  # only the block on the data's spans is factorized
        kind_b = solve_kind(d, n_samples, ridge, lowrank, command, n=block)
        return lambda k: block_solve_bytes(block, kind_b) if k == d else solve(k)
    if pass_need is not None:
        return lambda k: max(pass_need(k), solve(k))
    return solve


def floor_bytes(d: int) -> int:
    """The least that any job building psi x psi statistics of d-dim tokens holds (`FLOOR_COPIES`
    q x q float64 matrices of the span pass, q = d (d + 1) / 2): below every command's own need."""
    q = d * (d + 1) // 2
    return FLOOR_COPIES * 8 * q * q + SLACK_BYTES


def largest_d(budget_bytes: int, need: Callable[[int], int] | None = None, below: int | None = None) -> int:
    """The largest d (< `below`, if given) whose `need(d)` (default: a whole serial featurize) fits
    in `budget_bytes`; 0 if not even d = 1 fits."""
    need = need or featurize_bytes
    fits = 0
    while (below is None or fits + 1 < below) and need(fits + 1) <= budget_bytes:
        fits += 1
    return fits


# The dimension the refusal of too wide tokens suggests for `mhla reduce` (`check_floor`): docs/real_model.md fits a
# transformer's heads at d = 4 to 16 in minutes; the largest d memory allows (39 on 16 GiB) is a limit, not a choice.
SUGGESTED_DIM = 8


def reduce_hint(fits: int) -> str:
    """The advice of a refusal for too wide tokens: map them to `fits` dimensions (the slot {reduce} of a
    errors.Refused)."""
    if not fits:
        return ""
    return "; map the tokens to fewer dimensions first: {reduce}"


# The advice of every refusal of a psi x psi job that would exceed this machine: the cluster path, whose
# Gram stays tiled on the workers (mhla_cli.solve.cluster; the slot {cluster} of a errors.Refused).
CLUSTER_HINT = "; or keep the Gram tiled on a Dask cluster's workers: {cluster}"


def check_floor(d: int, path: str | os.PathLike | None = None, what: str = "the psi x psi statistics",
                budget_bytes: int | None = None) -> None:
    """Refuse up front tokens too wide for any job on psi x psi statistics (`floor_bytes`), before a
    byte of their size is allocated: one InputError leading with the remedy, `mhla reduce` to
    `SUGGESTED_DIM` dimensions (fewer if the machine takes fewer), then the memory fact (d, psi, the
    memory needed, the largest d whose featurize fits). Cheap: call it first in every such command."""
    if budget_bytes is None:
        budget_bytes = available_memory()
    total = floor_bytes(d)
    if total <= budget_bytes:
        return
    fits = largest_d(budget_bytes, below=d)
    fact = (f"d = {d} needs psi = {n_features(d)} features and at least {total / 2**30:.1f} GiB for {what}, more "
            f"than the {budget_bytes / 2**30:.1f} GiB of memory available")
    if not fits:
        raise InputError(f"{fact}; not even d = 1 fits", path)
    raise Refused(
        f"the tokens are too wide (d = {d}): map them to a few dimensions first: {{reduce}} (a transformer's heads are "
        f"fitted at d = 4 to 16: docs/real_model.md); {fact} (the largest d that fits is {fits}, a memory limit, not "
        "a sensible d)", path, reduce={"tokens": path or "TOKENS", "dim": min(SUGGESTED_DIM, fits)})


def check_memory(d: int, budget_bytes: int | None = None, copies: int = 1,
                 path: str | os.PathLike | None = None, need: Callable[[int], int] | None = None,
                 what: str = "the psi x psi statistics") -> None:
    """Refuse up front a d whose job would not fit in memory (an InputError naming the GiB it needs).

    `need(d)` is the job's peak in bytes (default: `copies` accumulators of featurize, one per worker
    process on this machine); `what` names the job in the message.
    """
    if budget_bytes is None:
        budget_bytes = available_memory()
    copies = max(1, int(copies))
    if need is None:
        def need(k: int) -> int:
            return featurize_bytes(k, workers=copies)
    total = need(d)
    if total > budget_bytes:
        fits = largest_d(budget_bytes, need, below=d)
        who = f" ({copies} workers)" if copies > 1 else ""
        remedies: dict[str, dict[str, object]] = {"cluster": {}}
        if fits:
            remedies["reduce"] = {"tokens": "TOKENS", "dim": fits}
        raise Refused(
            f"d = {d} needs psi = {n_features(d)} features and about {total / 2**30:.1f} GiB for {what}{who}, "
            f"more than the {budget_bytes / 2**30:.1f} GiB of memory available; "
            + (f"the largest d that fits is {fits}" if fits else "not even d = 1 fits") + reduce_hint(fits)
            + CLUSTER_HINT, path, **remedies)


def available_memory() -> int:
    """The bytes of memory available now (MemAvailable; the physical memory where /proc is missing)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 2**40
