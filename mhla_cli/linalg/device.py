"""Where the psi x psi work runs: numpy on the CPU (the default) or torch on a device (the `gpu` extra).

Spellings of `device` (CLI `--device`, library `device=`):

- "cpu" or None: numpy / SciPy on the CPU, the default;
- "cuda" or "cuda:I": torch on a CUDA GPU (with several workers each takes one, `worker_device`);
- "torch:cpu": the torch path on the CPU. Numerically it is the GPU path (same code, same float64
  operations), so the tests and a machine without a GPU can check it.

Everything the device computes is float64: the Gram accumulates float64 GEMMs (TF32 and reduced
precision only ever apply to float32 / half inputs, and none reach the device), the factorizations are
torch.linalg's float64 ones, and every result comes back as float64 numpy, the same `Features`,
eigenvalues and solutions as the numpy path.

The device holds the pass's Gram (`DeviceGram`: features built from each chunk's S entries and
last tokens on the device, one GEMM per chunk) and the factorization's matrix (`DeviceMatrix`).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import threading
from typing import Any, Protocol

import numpy as np

from ..errors import InputError, Refused

DEVICES_HELP = "cpu (numpy, the default), cuda, cuda:I (torch on a GPU), torch:cpu (the torch path on the CPU)"


def import_torch(what: str = "the device path", path: str | os.PathLike | None = None) -> Any:
    """torch, imported here for the whole package (the device backend, torch input files), or an
    InputError naming the file (`path`) and what needs it (`what`) when it is not installed."""
    try:
        import torch
    except ImportError:
        raise InputError(f"{what}: PyTorch is not installed; pip install 'torch>=2.1' (mhla's [gpu] extra)",
                         path) from None
    return torch


def _torch(device: str | None = None, path: str | os.PathLike | None = None) -> Any:
    """torch for the device `device` (`import_torch`)."""
    return import_torch(f"device {device!r}" if device else "the device path", path)


def check_device(device: str | None, path: str | os.PathLike | None = None) -> str | None:
    """Validate a device spelling before any work: None for numpy on the CPU, else the spelling.

    "cuda" without torch, without a CUDA GPU or with an index beyond the GPUs is an InputError.
    """
    if device is None or device == "cpu":
        return None
    if not isinstance(device, str):
        raise InputError(f"device must be a string ({DEVICES_HELP}), got {device!r}", path)
    if device == "torch:cpu":
        _torch(device, path)
        return device
    index = None
    if device.startswith("cuda:"):
        tail = device[5:]
        if not tail.isdigit():
            raise InputError(f"unknown device {device!r}: expected {DEVICES_HELP}", path)
        index = int(tail)
    elif device != "cuda":
        raise InputError(f"unknown device {device!r}: expected {DEVICES_HELP}", path)
    torch = _torch(device, path)
    if not torch.cuda.is_available():
        build = ("a CPU-only build" if torch.version.cuda is None else f"built with CUDA {torch.version.cuda}")
        raise Refused(f"device {device!r}: no CUDA GPU is available to PyTorch (torch {torch.__version__}, "
                      f"{build}); use {{cpu}}", path, cpu={})
    count = torch.cuda.device_count()
    if index is not None and index >= count:
        raise InputError(f"device {device!r}: there are {count} CUDA GPUs (cuda:0..cuda:{count - 1})", path)
    return device


def torch_device(device: str) -> Any:
    """The torch.device of a checked spelling ("torch:cpu" -> cpu)."""
    torch = _torch()
    return torch.device("cpu" if device == "torch:cpu" else device)


_THREADS: dict[int, int] = {}  # worker threads of this process, in the order they first asked
_THREADS_LOCK = threading.Lock()


def worker_device(device: str | None) -> str | None:
    """The device of the calling worker: "cuda" gives each worker one GPU in turn (a worker process of
    a pool by its number in the pool, a worker thread in the order the threads first ask; the main
    thread takes cuda:0). A Dask-CUDA worker sees one GPU (CUDA_VISIBLE_DEVICES) and takes it."""
    if device != "cuda":
        return device
    count = _torch().cuda.device_count()
    if count <= 1:
        return device
    worker = 0
    if mp.parent_process() is not None:  # a pool's worker process: its number in the pool (1, 2, ...)
        ident = mp.current_process()._identity
        worker = (ident[0] - 1) if ident else os.getpid()
    if threading.current_thread() is not threading.main_thread():
        with _THREADS_LOCK:
            worker += _THREADS.setdefault(threading.get_ident(), len(_THREADS))
    return f"cuda:{worker % count}"


def workers_per_device(device: str | None, workers: int) -> int:
    """How many of `workers` workers share one device: "cuda" spreads them over the GPUs."""
    if device != "cuda":
        return max(1, workers)
    return max(1, -(-workers // max(1, _torch().cuda.device_count())))


def free_bytes(device: str) -> int | None:
    """The device's free memory in bytes (None on the CPU: the host's memory check applies)."""
    dev = torch_device(device)
    if dev.type != "cuda":
        return None
    free, _total = _torch().cuda.mem_get_info(dev)
    return int(free)


class DeviceMemory(Protocol):
    """Where arrays are held (a backends.Backend): its device spelling and its free memory (None: the host's,
    which the host's memory check covers)."""

    device: str | None

    def free_bytes(self) -> int | None: ...


def check_device_memory(backend: DeviceMemory, need: int, what: str, path: str | os.PathLike | None = None) -> None:
    """Refuse up front a job whose arrays on the backend (`need` bytes) exceed its free memory."""
    free = backend.free_bytes()
    if free is not None and need > free:
        raise InputError(f"{what} needs about {need / 2**30:.1f} GiB on {backend.device}, more than its "
                         f"{free / 2**30:.1f} GiB of free memory", path)


# Row panels of the device Gram's update (DeviceGram.add): the flops are (1 + 1 / GRAM_PANELS) those of a syrk.
GRAM_PANELS = 8


class DeviceGram:
    """The Gram of a pass's [Ht | Y] block on a device, built chunk by chunk.

    Per chunk the host sends the transposed canonical S entries (q, R), last tokens (d, R) and targets
    (d, R) (through two alternating pinned buffers on a GPU, copied asynchronously, so that the host
    reads and prepares the next chunk while the device works); the device forms the features
    H_(j,k,l) = S[j,k] x_n[l] (docs/formats.md, "Math"), on the
    data's spans E^T s (x) F^T x_n when given, and adds the lower triangle of Ft Ft^T with float64
    GEMMs (one per row panel).
    """

    def __init__(self, device: str, width: int, nf: int, spans: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        torch = self._t = _torch()
        self.dev = torch_device(device)
        self.width, self.nf = int(width), int(nf)
        self.G = torch.zeros((self.width, self.width), dtype=torch.float64, device=self.dev)
        self.spans = None if spans is None else tuple(
            torch.as_tensor(np.ascontiguousarray(m, dtype=np.float64)).to(self.dev) for m in spans)
        self._pin = self.dev.type == "cuda"
        self._slots: list[dict[str, Any]] = [{}, {}]  # alternating pinned staging buffers
        self._events: list[Any] = [None, None]
        self._turn = 0

    def _send(self, slot: dict[str, Any], name: str, a: np.ndarray) -> Any:
        """A float64 host array on the device (through a pinned buffer on a GPU)."""
        t = self._t
        if not self._pin:
            return t.from_numpy(np.ascontiguousarray(a, dtype=np.float64)).to(self.dev)
        buf = slot.get(name)
        if buf is None or buf.numel() < a.size:
            buf = slot[name] = t.empty(max(a.size, 1), dtype=t.float64, pin_memory=True)
        host = buf[:a.size].view(a.shape)
        host.numpy()[...] = a
        return host.to(self.dev, non_blocking=True)

    def _stage(self, upper_t: np.ndarray, last_t: np.ndarray, targets_t: np.ndarray | None) -> tuple[Any, Any, Any]:
        """The chunk's factors on the device (E^T s and F^T x_n on the data's spans), through the
        alternating pinned buffers."""
        t = self._t
        k = self._turn
        self._turn = 1 - k
        if self._events[k] is not None:
            self._events[k].synchronize()  # the slot's previous copies have left its pinned buffers
        slot = self._slots[k]
        u = self._send(slot, "u", upper_t)
        x = self._send(slot, "x", last_t)
        y = None if targets_t is None else self._send(slot, "y", targets_t)
        if self._pin:
            self._events[k] = t.cuda.Event()
            self._events[k].record()
        if self.spans is not None:
            u, x = self.spans[0].T @ u, self.spans[1].T @ x
        return u, x, y

    def add(self, upper_t: np.ndarray, last_t: np.ndarray, targets_t: np.ndarray | None) -> None:
        """G += Ft Ft^T for the chunk's rows: upper_t (q, R) canonical S entries, last_t (d, R)
        (sqrt(w) x for weighted rows), targets_t (d, R) or None (already weighted)."""
        t = self._t
        R = upper_t.shape[1]
        if R == 0:
            return
        u, x, y = self._stage(upper_t, last_t, targets_t)
        Ft = t.empty((self.width, R), dtype=t.float64, device=self.dev)
        t.mul(u[:, None, :], x[None, :, :], out=Ft[:self.nf].view(u.shape[0], x.shape[0], R))
        if y is not None:
            Ft[self.nf:] = y
        # the lower triangle (mirrored on the host, backends.gram_parts) in GRAM_PANELS row panels,
        # each one float64 GEMM G[a:b, :b] += Ft[a:b] Ft[:b]^T: torch has no syrk, and a whole GEMM
        # would do twice its flops; P panels do (1 + 1/P) times them
        W = self.width
        step = max(1, -(-W // GRAM_PANELS))
        for a in range(0, W, step):
            b = min(W, a + step)
            self.G[a:b, :b].addmm_(Ft[a:b], Ft[:b].T)

    def result(self) -> np.ndarray:
        """The Gram as a float64 host array (the device's copy released)."""
        G = self.G.cpu().numpy()
        self.G = None
        return G


# Entries of one panel of U^T in DevicePairs.add (a gather of pair products, then one GEMM).
PAIRS_PANEL_ELEMENTS = 1 << 23


class DevicePairs(DeviceGram):
    """The distinct entries K = U^T V of the Gram of a pass's features on a device (mhla_cli.linalg.symgram),
    with the moments and the target Gram beside, built chunk by chunk as `DeviceGram` (same staging).

    Per chunk: V^T = the pair products x_l x_m (l <= m) of the token factor, then panels of rows of
    U^T (the pair products s_a s_b, a <= b, gathered for a range of pairs, at most PAIRS_PANEL_ELEMENTS
    entries), each one float64 GEMM K[panel] += U^T[panel] V; moments += s Z^T, Z = x (x) y.
    """

    def __init__(self, device: str, q: int, r: int, n_targets: int,
                 spans: tuple[np.ndarray, np.ndarray] | None = None) -> None:
        from .symgram import pairs_shape

        torch = self._t = _torch()
        self.dev = torch_device(device)
        self.q, self.r, self.nt = int(q), int(r), int(n_targets)
        f64 = dict(dtype=torch.float64, device=self.dev)
        self.K = torch.zeros(pairs_shape(self.q, self.r), **f64)
        self.M = torch.zeros((self.q, self.r * self.nt), **f64) if self.nt else None
        self.Y = torch.zeros((self.nt, self.nt), **f64) if self.nt else None
        self._ia, self._ib = (torch.as_tensor(i).to(self.dev) for i in np.triu_indices(self.q))
        self._il, self._im = (torch.as_tensor(i).to(self.dev) for i in np.triu_indices(self.r))
        self.spans = None if spans is None else tuple(
            torch.as_tensor(np.ascontiguousarray(m, dtype=np.float64)).to(self.dev) for m in spans)
        self._pin = self.dev.type == "cuda"
        self._slots = [{}, {}]
        self._events = [None, None]
        self._turn = 0

    def add(self, upper_t: np.ndarray, last_t: np.ndarray, targets_t: np.ndarray | None) -> None:
        """K += U^T V (and the moments, the target Gram) for the chunk's rows, as `DeviceGram.add`."""
        R = upper_t.shape[1]
        if R == 0:
            return
        u, x, y = self._stage(upper_t, last_t, targets_t)
        V = x[self._il] * x[self._im]  # (r(r+1)/2, R)
        n = self._ia.numel()
        step = max(1, PAIRS_PANEL_ELEMENTS // R)
        for a in range(0, n, step):
            b = min(n, a + step)
            self.K[a:b].addmm_(u[self._ia[a:b]] * u[self._ib[a:b]], V.T)
        if self.M is not None and self.Y is not None and y is not None:
            Z = (x[:, None, :] * y[None, :, :]).reshape(self.r * self.nt, R)
            self.M.addmm_(u, Z.T)
            self.Y.addmm_(y, y.T)

    def add_windows(self, upper_t: np.ndarray, xx: np.ndarray, xy: np.ndarray | None, yy: np.ndarray | None) -> None:
        """K += U^T V (and the moments, the target Gram) for rows whose token factor is a second moment
        (samples.Rows.xx: V from the pairs l <= m of xx (R, d, d), the moments from xy (R, d, n_targets));
        the host's `backends.HostGram.add_windows` on the device."""
        R = upper_t.shape[1]
        if R == 0:
            return
        t = self._t
        k = self._turn
        self._turn = 1 - k
        if self._events[k] is not None:
            self._events[k].synchronize()
        slot = self._slots[k]
        u = self._send(slot, "u", upper_t)
        m = self._send(slot, "x", np.asarray(xx, dtype=np.float64))
        z = None if xy is None or self.M is None else self._send(slot, "y", np.asarray(xy, dtype=np.float64))
        if self._pin:
            self._events[k] = t.cuda.Event()
            self._events[k].record()
        if self.spans is not None:  # E^T s, F^T xx F, F^T xy
            E, F = self.spans
            u, m = E.T @ u, F.T @ m @ F
            z = None if z is None else F.T @ z
        V = m[:, self._il, self._im].T  # (r(r+1)/2, R)
        n = self._ia.numel()
        step = max(1, PAIRS_PANEL_ELEMENTS // R)
        for a in range(0, n, step):
            b = min(n, a + step)
            self.K[a:b].addmm_(u[self._ia[a:b]] * u[self._ib[a:b]], V.T)
        if z is not None:
            assert self.M is not None  # z is None without the moments
            self.M.addmm_(u, z.reshape(R, self.r * self.nt))
            if yy is not None:
                self.Y += t.as_tensor(np.asarray(yy, dtype=np.float64)).to(self.dev)

    def result(self) -> Any:  # a symgram.SymGram on the host
        """The sums as a host `symgram.SymGram` (the device's copies released)."""
        from .symgram import SymGram

        out = SymGram(self.q, self.r, self.nt)
        out.K = self.K.cpu().numpy()
        if self.M is not None and self.Y is not None:
            out.M, out.Y = self.M.cpu().numpy(), self.Y.cpu().numpy()
        self.K = self.M = self.Y = None
        return out


class DeviceMatrix:
    """A symmetric float64 matrix on a device and the factorizations mhla_cli.linalg.factorization asks of it
    (the torch backend's matrix: mhla_cli.linalg.backends)."""

    selects_eigenvectors = False  # torch.linalg has no selected eigenvectors: the null space takes all
    solves_on_range = False  # the range solve goes through the eigenvectors (Factorization.range_solve)

    def __init__(self, a: Any, device: str) -> None:
        torch = self._t = _torch()
        self.device = device
        self.dev = torch_device(device)
        # a numpy array (on the CPU its memory is shared: it is only read) or a tensor already there
        self.a = (a if isinstance(a, torch.Tensor) else torch.as_tensor(np.asarray(a, dtype=np.float64))).to(self.dev)

    def eigvalsh(self) -> np.ndarray:
        return self._t.linalg.eigvalsh(self.a).cpu().numpy()

    def eigh(self) -> tuple[np.ndarray, np.ndarray]:
        w, v = self._t.linalg.eigh(self.a)
        return w.cpu().numpy(), v.cpu().numpy()

    def matvec(self, x: np.ndarray) -> np.ndarray:
        return (self.a @ self._t.from_numpy(np.ascontiguousarray(x, dtype=np.float64)).to(self.dev)).cpu().numpy()

    matmat = matvec  # a X for a block X (n x k): the same product on the device

    def cholesky(self, shift: float = 0.0) -> DeviceFactor | None:
        """The Cholesky factor of a - shift I (a copy of a when shift != 0: a is never written); None when
        that matrix is not numerically positive definite."""
        t = self._t
        if shift:
            m = self.a.clone()
            m.diagonal().sub_(float(shift))
        else:
            m = self.a
        L, info = t.linalg.cholesky_ex(m)
        del m
        if int(info) != 0 or not bool(t.isfinite(L.diagonal()).all()):
            return None
        return DeviceFactor(L)

    def shifted_solve(self, scale: float, shift: float, rhs: np.ndarray) -> np.ndarray | None:
        """(scale a + shift I) x = rhs by a Cholesky of a new device matrix (the ridge fit, for a shift
        above the certificate's tolerance: mhla_cli.linalg.factorization.Factorization.ridge_solve); None when it
        is not numerically positive definite."""
        m = DeviceMatrix(self.a * scale, self.device)  # a new array: `a` is never written (it may be the host's)
        m.a.diagonal().add_(float(shift))
        f = m.cholesky()
        return f.solve(rhs) if f is not None else None


class DeviceFactor:
    """A Cholesky factor L (a = L L^T) on a device: solves and inverse products through it."""

    def __init__(self, L: Any) -> None:
        self._t = _torch()
        self.L = L

    def solve(self, rhs: np.ndarray) -> np.ndarray:
        """a^-1 rhs through the factor."""
        b = self._t.from_numpy(np.ascontiguousarray(rhs, dtype=np.float64)).to(self.L.device)
        vec = b.ndim == 1
        x = self._t.cholesky_solve(b[:, None] if vec else b, self.L)
        return (x[:, 0] if vec else x).cpu().numpy()

    def inverse_matvec(self, x: np.ndarray) -> np.ndarray:
        """a^-1 x by two triangular solves with the factor (the ARPACK fallback of Lanczos)."""
        return self.inverse_matmat(np.asarray(x)[:, None])[:, 0]

    def inverse_matmat(self, X: np.ndarray) -> np.ndarray:
        """a^-1 X for a block X (n x k) by two triangular solves with the factor (block Lanczos)."""
        t = self._t
        b = t.from_numpy(np.ascontiguousarray(X, dtype=np.float64)).to(self.L.device)
        z = t.linalg.solve_triangular(self.L, b, upper=False)
        return t.linalg.solve_triangular(self.L.T, z, upper=True).cpu().numpy()


def predict_last(coef: np.ndarray, upper: np.ndarray, last: np.ndarray, device: str) -> np.ndarray:
    """Last-token predictions H coef^T on the device without forming H: upper (B, q) the S entries
    j <= k, last (B, d), coef (D_out, psi) in the features' (pair, l) order; returns (B, D_out) float64.

    pred[b, a] = sum_l (sum_p upper[b, p] coef[a, p, l]) last[b, l]: one GEMM (B x q) (q x d^2), then
    a batched contraction with the last tokens."""
    t = _torch()
    dev = torch_device(device)
    e, d = coef.shape[0], last.shape[1]  # the outputs' width D_out and the tokens' d
    q = upper.shape[1]
    P = t.as_tensor(np.ascontiguousarray(coef, dtype=np.float64)).to(dev).reshape(e, q, d)
    U = t.as_tensor(np.ascontiguousarray(upper, dtype=np.float64)).to(dev)
    x = t.as_tensor(np.ascontiguousarray(last, dtype=np.float64)).to(dev)
    M = (U @ P.permute(1, 0, 2).reshape(q, e * d)).reshape(-1, e, d)  # M[b, a, l]
    return t.bmm(M, x[:, :, None])[:, :, 0].cpu().numpy()
