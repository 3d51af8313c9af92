"""The Gram of the cubic features from its distinct entries: K = U^T V (docs/formats_features.md, "Compact features files").

A feature vector is h = s (x) x (s: the q pair entries of S, scaled as the caller wants; x: the d
entries of the last token), so

    Gram[(a,l),(b,m)] = sum_i w_i s_ia s_ib x_il x_im

is symmetric in (a, b) and in (l, m) separately: its distinct entries are the
q(q+1)/2 x d(d+1)/2 matrix

    K[(a<=b), (l<=m)] = sum_i U[i,(a<=b)] V[i,(l<=m)],   U[i,(a,b)] = s_ia s_ib,  V[i,(l,m)] = x_il x_im,

one GEMM of N psi^2 / 2 flops against the N psi^2 of a syrk on the materialised features. U is
formed panel by panel (the rows (a, b >= a) of U^T are the contiguous product s_a * s_a:), in a
reused buffer small enough to stay in cache. `gram_from_pairs` expands K to the (q d, q d) Gram
(the diagonal pairs a = b and l = m included), `pairs_from_gram` takes it back. The moments
sum_i w_i h_i y_i^T and the target Gram are accumulated beside K (`SymGram`).

`Pairs` holds K in place of the Gram (mhla_cli.statistics.features.Features.basis_gram, expanded when
first read): a change of basis h -> kron(P, R) h of the rows (s -> P s, x -> R x) acts on the two
factors separately, K -> the K of kron(P, R) Gram kron(P, R)^T (`Pairs.congruence`), a quarter of the
numbers and about half the flops of the same congruence on the expanded Gram.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from functools import lru_cache
from typing import Any

import numpy as np

__all__ = ["Pairs", "SYMGRAM_MIN_D", "SymGram", "accumulator", "gram_from_pairs", "n_pairs", "pair_positions",
           "pairs_from_gram", "pairs_shape", "use_pairs"]

# Token dimension (the length of the token factor x; on the data's spans, both factors' widths) from
# which the accumulation builds K rather than one dsyrk of the materialised [H | Y] block: the time
# ratio K / dsyrk (`python benchmarks/bench_gflops.py --kernel 6 8 10 12 16 24`) crosses 1 near d = 12.
# Below it the loop over the panels, the separate moments GEMM and the formation of U cost more than
# the syrk flops they save.
SYMGRAM_MIN_D = 12
# Bytes of one panel of U^T (the rows (a, b >= a) of consecutive a, merged until the panel holds
# about this much): one GEMM per panel. Large panels, because every BLAS call with several threads
# pays a wait for the cores when the machine is shared (one small GEMM per a-block pays it over a
# hundred times per chunk); with one BLAS thread the panel size hardly matters. A wide block's panels
# go over Python threads, one BLAS thread each (`SymGram.add`'s `threads`).
PAIRS_PANEL_BYTES = 32 * 2**20


def n_pairs(n: int) -> int:
    """n (n + 1) / 2: the distinct entries (a <= b) of a symmetric n x n matrix."""
    return n * (n + 1) // 2


def pairs_shape(q: int, d: int) -> tuple[int, int]:
    """The shape (q(q+1)/2, d(d+1)/2) of K for pair factors of length q and token factors of length d."""
    return n_pairs(q), n_pairs(d)


@lru_cache(maxsize=64)
def pair_positions(n: int) -> np.ndarray:
    """(n, n) intp: the position of the pair (min(a, b), max(a, b)) in the upper-triangle order
    (a, then b >= a) of n entries."""
    a, b = np.triu_indices(n)
    idx = np.empty((n, n), dtype=np.intp)
    pos = np.arange(a.size, dtype=np.intp)
    idx[a, b] = pos
    idx[b, a] = pos
    idx.setflags(write=False)
    return idx


def _pair_products(f: np.ndarray, out: np.ndarray) -> None:
    """out[(a<=b), :] = f[a] * f[b] for f (n, R) C-contiguous; out (n(n+1)/2, R)."""
    n = f.shape[0]
    r = 0
    for a in range(n):
        np.multiply(f[a], f[a:], out=out[r:r + n - a])
        r += n - a


def work_array(pool: dict[str, np.ndarray], name: str, rows: int, cols: int) -> np.ndarray:
    """A reusable C-contiguous (rows, cols) float64 work array from `pool` (grown, never shrunk)."""
    size = rows * cols
    buf = pool.get(name)
    if buf is None or buf.size < size:
        buf = pool[name] = np.empty(size)
    return buf[:size].reshape(rows, cols)


class SymGram:
    """Running K, moments and target Gram of rows h_i = s_i (x) x_i (weights folded in by the caller:
    sqrt(w) x and sqrt(w) y give w h h^T).

    `add(s_t, x_t, y_t)` takes one chunk transposed: s_t (q, R), x_t (d, R), y_t (n_targets, R) or
    None, float64 (every elementwise loop runs over the R samples). Per chunk: V^T (d(d+1)/2, R) once,
    then for each panel of rows (a, b >= a) of U^T (whole a-blocks, about PAIRS_PANEL_BYTES, in one
    reused buffer) one GEMM K[panel] += U^T[panel] V; moments += s (x) (x y^T) as one GEMM s_t @ Z^T with
    Z = x (x) y (d n_targets, R).
    """

    def __init__(self, q: int, d: int, n_targets: int = 0) -> None:
        self.q, self.d, self.t = int(q), int(d), int(n_targets)
        self.K = np.zeros(pairs_shape(self.q, self.d))
        self.M = np.zeros((self.q, self.d * self.t)) if self.t else None  # moments (a, l, target)
        self.Y = np.zeros((self.t, self.t)) if self.t else None
        self._work: dict[str, np.ndarray] = {}
        self._pool: Any = None  # the executor while `pipeline` is open
        self._threads = 1
        self._pending: list[Any] = []  # the futures of the chunk in flight

    def _buf(self, name: str, rows: int, cols: int) -> np.ndarray:
        return work_array(self._work, name, rows, cols)

    @contextlib.contextmanager
    def pipeline(self, threads: int) -> Iterator[None]:
        """Within it `add` returns once a chunk's panels are handed out to `threads` Python threads, so that
        they run while the caller prepares the next chunk (its per-sequence moments on the main thread left
        a core idle: ~10 % of a chunk at d = 16); `add` joins the chunk in flight before it hands out the
        next, and the exit joins the last, on an error too. The sums are those of the blocking `add`, bit
        for bit (the same GEMMs into the same rows, one chunk after the other).

        BLAS is held at one thread for the whole block (each panel's GEMM on one BLAS thread, as in the
        blocking form): a limit set and restored per chunk while the caller's own one-thread blocks come
        and go on the main thread would interleave and leave a panel on two BLAS threads. One thread or a
        pipeline already open: nothing changes."""
        n = int(threads)
        if n <= 1 or self._pool is not None:
            yield
            return
        from concurrent.futures import ThreadPoolExecutor

        from threadpoolctl import threadpool_limits

        with threadpool_limits(limits=1, user_api="blas"), ThreadPoolExecutor(n) as pool:
            self._pool, self._threads = pool, n
            try:
                yield
            except BaseException:
                self.join(quiet=True)
                raise
            else:
                self.join()
            finally:
                self._pool, self._threads = None, 1

    def join(self, quiet: bool = False) -> None:
        """Wait for the chunk in flight (`pipeline`) and raise its first error (none with `quiet`)."""
        pending, self._pending = self._pending, []
        if not pending:
            return
        from concurrent.futures import wait

        wait(pending)
        for f in pending:
            if not quiet and f.exception() is not None:
                raise f.exception()

    def add(self, s_t: np.ndarray, x_t: np.ndarray, y_t: np.ndarray | None = None, threads: int = 1) -> None:
        """Add the chunk's rows (module docstring); s_t (q, R), x_t (d, R), y_t (d, R) or None.

        `threads` > 1: the panels and the moments are shared out over that many Python threads, each
        forming its panels in its own buffer and running their GEMMs on one BLAS thread (numpy and BLAS
        release the GIL): the memory-bound formation of U runs in parallel too, and no BLAS call waits
        for a second core. The sums do not depend on it (each panel is one GEMM into its own rows of K;
        the moments one GEMM). Within `pipeline` the chunk is copied and handed out to the pipeline's
        threads (`threads` is then not read) and `add` returns before its GEMMs end."""
        q, d = self.q, self.d
        R = s_t.shape[1]
        if R == 0 or q == 0 or d == 0:
            return
        self.join()  # the chunk in flight reads the work buffers below
        if self._pool is not None:  # the caller reuses its buffers while this chunk's GEMMs run
            s_t = _copy_into(self._buf("s_in", q, R), s_t)
            x_t = _copy_into(self._buf("x_in", d, R), x_t)
            if y_t is not None:
                y_t = _copy_into(self._buf("y_in", y_t.shape[0], R), y_t)
        s_t = np.ascontiguousarray(s_t, dtype=np.float64)
        x_t = np.ascontiguousarray(x_t, dtype=np.float64)
        Vt = self._buf("V", n_pairs(d), R)
        _pair_products(x_t, Vt)

        def moments() -> None:
            assert self.M is not None and self.Y is not None and y_t is not None  # called only then
            Z = self._buf("Z", d * self.t, R).reshape(d, self.t, R)
            np.multiply(x_t[:, None, :], y_t[None, :, :], out=Z)
            self.M += s_t @ Z.reshape(d * self.t, R).T
            self.Y += y_t @ y_t.T
        self._add_factors(s_t, Vt, moments if self.M is not None and y_t is not None else None, threads)

    def add_windows(self, s_t: np.ndarray, xx: np.ndarray, xy: np.ndarray | None = None, yy: np.ndarray | None = None,
                    threads: int = 1) -> None:
        """Add rows whose token factor is a second moment rather than x x^T: row i adds (s_i s_i^T) (x) xx_i
        to the Gram and s_i (x) xy_i to the moments (a window of an encoder: xx = X^T W X, xy = X^T W Y over
        its positions, mhla_cli.samples.Rows), and yy to the target Gram. s_t (q, R), xx (R, d, d) symmetric,
        xy (R, d, n_targets) or None, yy (n_targets, n_targets) or None; the panels as in `add`."""
        q, d = self.q, self.d
        R = s_t.shape[1]
        if R == 0:
            return
        if q == 0 or d == 0:  # a block of no features (a pass of the sums only): the targets' Gram still adds
            if self.Y is not None and yy is not None:
                self.join()
                self.Y += yy
            return
        self.join()
        if self._pool is not None:
            s_t = _copy_into(self._buf("s_in", q, R), s_t)
        s_t = np.ascontiguousarray(s_t, dtype=np.float64)
        il, im = np.triu_indices(d)  # the pair order of `_pair_products`
        Vt = self._buf("V", n_pairs(d), R)
        np.copyto(Vt, np.take(np.asarray(xx, dtype=np.float64).reshape(R, d * d), il * d + im, axis=1).T)
        moments = None
        if self.M is not None and xy is not None:
            Zt = self._buf("Z", d * self.t, R)
            np.copyto(Zt, np.asarray(xy, dtype=np.float64).reshape(R, d * self.t).T)
            yy_sum = np.array(yy, dtype=np.float64) if yy is not None else None

            def moments() -> None:
                assert self.M is not None and self.Y is not None  # called only with moments (self.t > 0)
                self.M += s_t @ Zt.T
                if yy_sum is not None:
                    self.Y += yy_sum
        self._add_factors(s_t, Vt, moments, threads)

    def _add_factors(self, s_t: np.ndarray, Vt: np.ndarray, moments: Any, threads: int) -> None:
        """K += U^T V for the pair factor s_t (q, R) and the token factor's pairs Vt (d(d+1)/2, R), panel by
        panel, and `moments()` (None: none) beside them, on `threads` Python threads (`add`)."""
        q, R = self.q, s_t.shape[1]
        if self._pool is not None:
            threads = self._threads
        # panels of the rows (a, b >= a) of U^T: whole a-blocks, merged up to about PAIRS_PANEL_BYTES
        limit = max(1, PAIRS_PANEL_BYTES // (8 * R))
        panels = []  # (a, a1, first row of K, rows)
        a, row = 0, 0
        while a < q:
            a1, rows = a, 0
            while a1 < q and (rows == 0 or rows + (q - a1) <= limit):
                rows += q - a1
                a1 += 1
            panels.append((a, a1, row, rows))
            row += rows
            a = a1
        n = max(1, min(int(threads), len(panels)))
        # the work of each thread: panels (and the moments, the GEMM of q x (d n_targets) columns, as
        # many flops as a panel of q d n_targets / (d(d+1)/2) rows), largest first to the least loaded
        # thread (the longest-processing-time rule: the loads end within one panel of each other)
        tasks = [(rows, i) for i, (_, _, _, rows) in enumerate(panels)]
        if moments is not None:
            tasks.append((q * self.d * self.t // max(Vt.shape[0], 1), -1))  # -1: the moments
        load = [0] * n
        share: list[list[int]] = [[] for _ in range(n)]
        for cost, i in sorted(tasks, reverse=True):
            k = load.index(min(load))
            load[k] += cost
            share[k].append(i)

        def run(part: int) -> None:
            P0 = self._buf(f"U{part}", min(n_pairs(q), limit + q), R)
            for i in share[part]:
                if i < 0:
                    moments()
                    continue
                a, a1, row, rows = panels[i]
                P = P0[:rows]
                r = 0
                for c in range(a, a1):
                    np.multiply(s_t[c], s_t[c:], out=P[r:r + q - c])
                    r += q - c
                # K[panel]^T = V^T U[panel] into a small block, added transposed: this orientation of the
                # same GEMM is the faster of the two (docs/performance_symmetry.md, "Where the time goes")
                T = self._buf(f"T{part}", Vt.shape[0], rows)
                np.matmul(Vt, P.T, out=T)
                self.K[row:row + rows] += T.T
        if self._pool is not None:
            self._pending = [self._pool.submit(run, k) for k in range(n)]
        elif n == 1:
            run(0)
        else:
            from concurrent.futures import ThreadPoolExecutor

            from threadpoolctl import threadpool_limits

            # every GEMM of the chunk on one BLAS thread, the moments' too: the pool's threads already
            # hold the cores, and BLAS threads on top of them wait for one another (docs/performance.md,
            # "BLAS threads"; docs/performance_symmetry.md, "Where the time goes")
            with threadpool_limits(limits=1, user_api="blas"), ThreadPoolExecutor(n) as pool:
                list(pool.map(run, range(n)))

    def release_work(self) -> None:
        """Free the per-chunk work buffers (before the Gram is expanded)."""
        self.join()
        self._work.clear()

    def gram(self) -> np.ndarray:
        """The (q d, q d) Gram of the rows (exactly symmetric), from K."""
        self.join()
        return gram_from_pairs(self.K, self.q, self.d)

    def moments(self) -> np.ndarray | None:
        """sum_i w_i h_i y_i^T, (q d, n_targets) (feature order: a, then l fastest)."""
        self.join()
        return None if self.M is None else self.M.reshape(self.q * self.d, self.t).copy()

    def target_gram(self) -> np.ndarray | None:
        """sum_i w_i y_i y_i^T, (n_targets, n_targets)."""
        self.join()
        return None if self.Y is None else 0.5 * (self.Y + self.Y.T)


def _copy_into(buf: np.ndarray, a: np.ndarray) -> np.ndarray:
    """a (any float dtype, any layout) copied into the C-contiguous float64 buffer of its shape."""
    np.copyto(buf, a)
    return buf


def gram_from_pairs(K: np.ndarray, q: int, d: int, out: np.ndarray | None = None) -> np.ndarray:
    """The (q d, q d) Gram from its distinct entries K (q(q+1)/2, d(d+1)/2): Gram[(a,l),(b,m)] =
    K[(min(a,b), max(a,b)), (min(l,m), max(l,m))], written one row block a at a time (no
    temporaries of the Gram's size). Exactly symmetric."""
    n = q * d
    G = np.empty((n, n)) if out is None else out
    for _ in gram_rows(K, q, d, G):
        pass
    return G


def gram_rows(K: np.ndarray, q: int, d: int, out: np.ndarray | None = None, rows: int = 1
              ) -> Iterator[tuple[int, np.ndarray]]:
    """The rows of the (q d, q d) Gram of `gram_from_pairs`, a block at a time: yields (first row,
    block (k d, q d)) for consecutive pair indices a (k of them, k = max(1, rows // d)), written into
    `out`'s rows (the whole Gram) or into one reused block (so that a writer never holds the Gram)."""
    K = np.asarray(K, dtype=np.float64)
    if K.shape != pairs_shape(q, d):
        raise ValueError(f"K has shape {K.shape}, expected {pairs_shape(q, d)}")
    n = q * d
    k = max(1, int(rows) // max(d, 1))
    work = out if out is not None else np.empty((min(k, q) * d, n))
    Pq, Pd = pair_positions(q), pair_positions(d)
    pairs = np.empty((q, K.shape[1]))
    for a0 in range(0, q, k):
        a1 = min(q, a0 + k)
        block = work[a0 * d:a1 * d] if out is not None else work[:(a1 - a0) * d]
        for a in range(a0, a1):
            np.take(K, Pq[a], axis=0, out=pairs)  # (q, d(d+1)/2): the pairs (a, b) for every b, in cache
            for l in range(d):  # row (a, l), contiguous: G[(a,l), (b,m)] = pairs[b, (l, m)]
                np.take(pairs, Pd[l], axis=1, out=block[(a - a0) * d + l].reshape(q, d))
        yield a0 * d, block


def pairs_from_gram(G: np.ndarray, q: int, d: int) -> np.ndarray:
    """The distinct entries K (q(q+1)/2, d(d+1)/2) of a (q d, q d) Gram of rows s (x) x (the inverse
    of `gram_from_pairs`; of a Gram without that symmetry it returns the upper entries of each block)."""
    G4 = np.asarray(G).reshape(q, d, q, d)
    a, b = np.triu_indices(q)
    lo, mo = np.triu_indices(d)
    K = np.empty(pairs_shape(q, d))
    for r0 in range(0, a.size, 256):
        r1 = min(a.size, r0 + 256)
        blocks = G4[a[r0:r1], :, b[r0:r1], :]  # (rows, d, d)
        K[r0:r1] = blocks[:, lo, mo]
    return K


def token_pair_map(R: np.ndarray) -> np.ndarray:
    """T (r'(r'+1)/2, r(r+1)/2) with upper(R X R^T) = T upper(X) for symmetric X (r x r), R (r', r): the
    map of the token factor's pairs x_l x_m under x -> R x (pair order a, then b >= a)."""
    R = np.asarray(R, dtype=np.float64)
    lo, mo = np.triu_indices(R.shape[1])
    l2, m2 = np.triu_indices(R.shape[0])
    # (R X R^T)[l, m] = sum_{l' <= m'} X[l', m'] (R[l, l'] R[m, m'] + R[l, m'] R[m, l'] [l' < m'])
    T = R[l2][:, lo] * R[m2][:, mo]
    off = lo != mo
    T[:, off] += R[l2][:, mo[off]] * R[m2][:, lo[off]]
    return T


# Bytes of one block of rows of the Gram written from K (`Pairs.rows`: a features file's psi x psi
# datasets are written a block at a time, never held whole).
ROW_BLOCK_BYTES = 16 * 2**20
# Bytes of the expanded (columns, q, q) block of `Pairs.congruence`'s pair-factor step.
CONGRUENCE_BLOCK_BYTES = 16 * 2**20
# Row blocks of the pair step's second GEMM, each computed only from its diagonal on (the upper triangle
# of each column's P M P^T): (1 + 1 / blocks) / 2 of that GEMM's flops, 62.5 % with 4. The saving shows
# at d >= 32 only, and 2 to 16 blocks take about the same time.
PAIR_TRIANGLE_BLOCKS = 4


class Pairs:
    """The distinct entries K (q(q+1)/2, r(r+1)/2) of a (q r, q r) Gram of rows s (x) x, held instead of
    the Gram (`gram_from_pairs` expands it; `congruence` changes its basis on the factors)."""

    def __init__(self, K: np.ndarray, q: int, r: int) -> None:
        self.q, self.r = int(q), int(r)
        if K.shape != pairs_shape(self.q, self.r):
            raise ValueError(f"K has shape {K.shape}, expected {pairs_shape(self.q, self.r)}")
        self.K = K

    def __repr__(self) -> str:
        return f"<Gram ({self.q * self.r}, {self.q * self.r}) held as its distinct entries {self.K.shape}>"

    @property
    def shape(self) -> tuple[int, int]:
        """The shape of the Gram."""
        n = self.q * self.r
        return n, n

    def expand(self) -> np.ndarray:
        """The (q r, q r) Gram (`gram_from_pairs`)."""
        return gram_from_pairs(self.K, self.q, self.r)

    def rows(self, block_bytes: int = ROW_BLOCK_BYTES) -> Iterator[tuple[int, np.ndarray]]:
        """The Gram's rows in blocks of about `block_bytes`, one reused block (`gram_rows`)."""
        n = self.q * self.r
        return gram_rows(self.K, self.q, self.r, rows=max(1, block_bytes // (8 * max(n, 1))))

    def copy(self) -> Pairs:
        return Pairs(np.array(self.K), self.q, self.r)

    def congruence(self, P: np.ndarray, R: np.ndarray, overwrite: bool = False) -> Pairs:
        """The K of kron(P, R) Gram kron(P, R)^T, for P (q', q) and R (r', r): the rows s (x) x become
        (P s) (x) (R x), so the pairs of the token factor map by T = `token_pair_map(R)` (K -> K T^T: rows
        of K apart) and those of the pair factor by P M P^T of each column's symmetric (q, q) matrix M
        (two GEMMs per block of columns of about CONGRUENCE_BLOCK_BYTES expanded: columns apart).

        `overwrite` (square P and R, a writeable K): the result is written over this K, the pair step a
        block of columns and then the token step a block of rows at a time, so that nothing of K's size
        is allocated (also the faster form in a fresh process).
        Otherwise K T^T is one GEMM into a new array and the pair step runs over it in place (or into
        a second array when q' != q); K itself is unchanged. (A K T^T per block of the result's columns
        instead would reread all of K for every few columns.) The timings: docs/performance_symmetry.md,
        "Where the time goes"."""
        P = np.asarray(P, dtype=np.float64)
        R = np.asarray(R, dtype=np.float64)
        if P.shape[1] != self.q or R.shape[1] != self.r:
            raise ValueError(f"factors of shapes {P.shape}, {R.shape} do not act on pairs of lengths "
                             f"{self.q}, {self.r}")
        q, q2, r2 = self.q, P.shape[0], R.shape[0]
        T = token_pair_map(R)  # (r'(r'+1)/2, r(r+1)/2)
        cols = max(1, CONGRUENCE_BLOCK_BYTES // (8 * max(q, q2) ** 2))
        work: dict[str, np.ndarray] = {}
        in_place = (overwrite and q2 == q and r2 == self.r and self.K.flags.writeable
                    and self.K.flags.c_contiguous and self.K.dtype == np.float64)
        # the pair step reads src and writes dst a block of columns at a time (dst may be src)
        src = self.K if in_place else self.K @ T.T  # beside K: the token factor's pairs first, one GEMM
        dst = src if q2 == q else np.empty((n_pairs(q2), src.shape[1]))
        for c0 in range(0, src.shape[1], cols):
            c1 = min(src.shape[1], c0 + cols)
            dst[:, c0:c1] = _pair_congruence(src[:, c0:c1], P, work)
        if in_place:  # then the token factor's pairs, a block of rows at a time
            rows = max(1, CONGRUENCE_BLOCK_BYTES // (8 * max(T.shape[0], 1)))
            for r0 in range(0, dst.shape[0], rows):
                r1 = min(dst.shape[0], r0 + rows)
                dst[r0:r1] = dst[r0:r1] @ T.T
        return Pairs(dst, q2, r2)


def _pair_congruence(block: np.ndarray, P: np.ndarray, work: dict[str, np.ndarray]) -> np.ndarray:
    """The pair step of `Pairs.congruence` on a block of K's columns (q(q+1)/2, c): upper(P M_j P^T) of
    each column's symmetric (q, q) matrix M_j, (q'(q'+1)/2, c). The three (q or q', q or q', c)
    intermediates live in `work` (reused from block to block: `work_array`)."""
    q2, q = P.shape
    c = block.shape[1]
    M = work_array(work, "M", q, q * c)
    np.take(block, pair_positions(q), axis=0, out=M.reshape(q, q, c))  # each column's symmetric matrix
    Z = work_array(work, "Z", q2, q * c)
    np.matmul(P, M, out=Z)  # [a', (b, j)] = (P M_j)[a', b]
    Zt = work_array(work, "Zt", q, q2 * c)
    np.copyto(Zt.reshape(q, q2, c), Z.reshape(q2, q, c).transpose(1, 0, 2))
    Y = work_array(work, "Y", q2, q2 * c)
    # [b', (a', j)] = (P M_j P^T)[a', b'], symmetric in a', b': only the entries a' >= b' are kept, so the
    # rows b' of each of PAIR_TRIANGLE_BLOCKS blocks need only the columns a' >= the block's first row
    # (the rest of Y is never written nor read)
    step = -(-q2 // PAIR_TRIANGLE_BLOCKS)
    for b0 in range(0, q2, step):
        b1 = min(q2, b0 + step)
        np.matmul(P[b0:b1], Zt[:, b0 * c:], out=Y[b0:b1, b0 * c:])
    a2, b2 = np.triu_indices(q2)
    return Y.reshape(q2, q2, c)[a2, b2]


def use_pairs(q: int, d: int) -> bool:
    """Accumulate K (rather than a syrk of the materialised rows) for factors of lengths q and d:
    both at least SYMGRAM_MIN_D."""
    return min(q, d) >= SYMGRAM_MIN_D


def accumulator(q: int, d: int, n_targets: int = 0, pairs: bool = False) -> SymGram | None:
    """A SymGram for factors of lengths q and d when `use_pairs` says it gains or `pairs` asks for one (rows
    whose token factor is a second moment: `SymGram.add_windows`), else None (syrk)."""
    return SymGram(q, d, n_targets) if pairs or use_pairs(q, d) else None
