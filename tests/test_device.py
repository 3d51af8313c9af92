"""The torch device path (mhla_cli.linalg.device) against the numpy path, on the CPU ("torch:cpu").

"torch:cpu" runs the GPU path's code (features and Gram built by torch, factorizations by torch.linalg)
on the CPU; every result must equal the numpy path's to 1e-12 relative: gram, moments, lambda_min,
the learned p and the predictions, for dense, ragged, per-position, weighted and length-normalised
data, on the full statistics and on the data's spans. Skipped without torch.
"""

from __future__ import annotations

import sys
from pathlib import Path

import h5py
import numpy as np
import pytest

from mhla_cli.linalg import device as device_mod
from mhla_cli.linalg import factorization
from mhla_cli.model import forward
from mhla_cli.solve import certificate, lstsq
from mhla_cli.statistics import accumulate, stream
from mhla_cli.cli import run as main
from mhla_cli.errors import InputError
from mhla_cli.api.estimator import MHLA
from mhla_cli.statistics.ranges import accumulate_range
from mhla_cli.io.tokens import inspect_tokens

from conftest import relerr

try:
    import torch
except ImportError:  # the numpy path only: the device tests are skipped, the refusals still run
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="needs torch (the gpu extra)")

DEV = "torch:cpu"


def _write(path: Path, **arrays: np.ndarray) -> Path:
    with h5py.File(path, "w") as f:
        for k, v in arrays.items():
            f[k] = v
    return path


def _data(kind: str, tmp_path: Path, d: int = 4, seed: int = 0) -> tuple[Path, str]:
    """A tokens file of one kind and the normalisation to featurize it with."""
    rng = np.random.default_rng(seed)
    # tokens with one small-variance rotated direction: the whitening matters
    R = np.linalg.qr(rng.standard_normal((d, d)))[0] @ np.diag([1e-2] + [1.0] * (d - 1))
    if kind == "dense":
        X = rng.standard_normal((400, 6, d)) @ R
        return _write(tmp_path / "dense.h5", tokens=X, targets=rng.standard_normal((400, d))), "none"
    lengths = rng.integers(1, 10, size=400)
    off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    X = rng.standard_normal((int(off[-1]), d)) @ R
    if kind == "ragged":
        return _write(tmp_path / "ragged.h5", tokens=X, offsets=off, targets=rng.standard_normal((400, d))), "none"
    if kind == "length":
        return _write(tmp_path / "length.h5", tokens=X, offsets=off, targets=rng.standard_normal((400, d))), "length"
    if kind == "weighted":
        w = rng.uniform(0, 2, size=400)
        w[::7] = 0.0
        return _write(tmp_path / "weighted.h5", tokens=X, offsets=off, targets=rng.standard_normal((400, d)),
                      weights=w), "none"
    if kind == "per_position":
        T = int(off[-1])
        w = rng.uniform(0, 1, size=T)
        return _write(tmp_path / "causal.h5", tokens=X, offsets=off, targets=rng.standard_normal((T, d)),
                      weights=w), "none"
    raise ValueError(kind)


KINDS = ("dense", "ragged", "per_position", "weighted", "length")


@pytest.mark.parametrize("kind", KINDS)
@needs_torch
def test_featurize_certify_fit_equal_numpy(kind: str, tmp_path: Path) -> None:
    path, normalize = _data(kind, tmp_path)
    a = stream.featurize(path, normalize=normalize, chunk_size=97)
    b = stream.featurize(path, normalize=normalize, chunk_size=97, device=DEV)
    assert a.n_samples == b.n_samples and a.n_tokens == b.n_tokens
    for k in ("gram", "moments", "target_gram", "basis_gram", "basis_moments", "token_gram"):
        assert relerr(getattr(b, k), getattr(a, k)) < 1e-12, k
    ca, cb = certificate.certify_features(a), certificate.certify_features(b, device=DEV)
    assert ca.identifiable == cb.identifiable and ca.rank == cb.rank
    assert abs(ca.lambda_min - cb.lambda_min) <= 1e-12 * ca.lambda_max
    assert abs(ca.lambda_max - cb.lambda_max) <= 1e-12 * ca.lambda_max
    ma, mb = lstsq.fit(a), lstsq.fit(b, device=DEV)
    assert relerr(mb.coef, ma.coef) < 1e-10  # p: a solve with Lambda~'s condition (~1e2 here)
    assert relerr(lstsq.fit(b, ridge=0.1, device=DEV).coef, lstsq.fit(a, ridge=0.1).coef) < 1e-12


@pytest.mark.parametrize("dense_max", [4096, 0], ids=["dense", "cholesky-lanczos"])
@needs_torch
def test_factorization_paths_equal_numpy(dense_max: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both factorization paths (every eigenvalue, and Cholesky + Lanczos) on the device, and a
    singular Lambda~ (N < psi: the null space and the minimum-norm fit from torch's eigh)."""
    monkeypatch.setattr(factorization, "DENSE_MAX", dense_max)
    path, _ = _data("ragged", tmp_path)
    info = inspect_tokens(path)
    for n in (400, 20):  # identifiable; then N = 20 < psi = 40: singular
        a = accumulate_range(info, (0, n))
        b = accumulate_range(info, (0, n), device=DEV)
        ca, cb = certificate.certify_features(a), certificate.certify_features(b, device=DEV)
        assert ca.identifiable == cb.identifiable == (n == 400)
        assert ca.rank == cb.rank
        assert abs(ca.lambda_min - cb.lambda_min) <= 1e-12 * ca.lambda_max
        ma, mb = lstsq.fit(a), lstsq.fit(b, device=DEV)
        assert relerr(mb.coef, ma.coef) < 1e-10


@needs_torch
def test_spans_block_on_device(tmp_path: Path) -> None:
    """One-hot tokens: the data's spans leave most of psi out; the block accumulated on the device
    equals the numpy one, and so do the verdict and lambda_min."""
    rng = np.random.default_rng(1)
    d = 12
    X = np.eye(d)[rng.integers(0, 3, size=(800, 5))]  # only 3 of 12 coordinates ever appear
    path = _write(tmp_path / "onehot.h5", tokens=X, targets=rng.standard_normal((800, d)))
    a = stream.featurize(path, spans="on")
    b = stream.featurize(path, spans="on", device=DEV)
    assert a.on_spans and b.on_spans
    assert relerr(b.basis_gram, a.basis_gram) < 1e-12
    ca, cb = certificate.certify_features(a), certificate.certify_features(b, device=DEV)
    assert ca.identifiable == cb.identifiable and ca.rank == cb.rank and ca.span_features == cb.span_features
    assert abs(ca.lambda_min - cb.lambda_min) <= 1e-12 * ca.lambda_max


@needs_torch
def test_workers_and_predict_on_device(tmp_path: Path) -> None:
    path, _ = _data("ragged", tmp_path)
    a = stream.featurize(path)
    b = stream.featurize(path, workers=2, device=DEV)
    assert relerr(b.basis_gram, a.basis_gram) < 1e-12
    model = lstsq.fit(a)
    pa = forward.predict_file(model, path)
    pb = forward.predict_file(model, path, device=DEV, workers=2)
    assert relerr(pb.predictions, pa.predictions) < 1e-12
    assert abs(pb.mse - pa.mse) <= 1e-12 * pa.mse


@needs_torch
def test_estimator_device(tmp_path: Path) -> None:
    rng = np.random.default_rng(2)
    X, y = rng.standard_normal((300, 5, 3)), rng.standard_normal((300, 3))
    a = MHLA().fit(X, y)
    b = MHLA(device=DEV).fit(X, y)
    assert b.get_params()["device"] == DEV
    assert relerr(b.coef_, a.coef_) < 1e-10
    assert relerr(b.predict(X), a.predict(X)) < 1e-10
    assert b.certificate_.identifiable == a.certificate_.identifiable


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "cuda:-1", "tpu:0", ""])
def test_unknown_device_refused(bad: str, tmp_path: Path) -> None:
    path, _ = _data("dense", tmp_path)
    with pytest.raises(InputError, match="device"):
        stream.featurize(path, device=bad)


def test_device_memory_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from mhla_cli.linalg.backends import NUMPY, TorchBackend

    monkeypatch.setattr(device_mod, "free_bytes", lambda device: 2**20)
    with pytest.raises(InputError, match="GiB on cuda"):
        device_mod.check_device_memory(TorchBackend("cuda"), 2**31, "featurize")
    device_mod.check_device_memory(NUMPY, 2**40, "featurize")  # the numpy path: the host's check applies
@needs_torch
def test_cuda_without_gpu_refused_before_work(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    path, _ = _data("dense", tmp_path)
    with pytest.raises(InputError, match="no CUDA GPU"):
        device_mod.check_device("cuda:0")
    out = tmp_path / "f.h5"
    assert main(["featurize", str(path), "-o", str(out), "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mhla: error:") and "CUDA" in err[0]
    assert not out.exists()


@needs_torch
def test_cli_device_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--device torch:cpu on featurize, certify, fit and predict gives the numpy path's numbers."""
    import json

    path, _ = _data("ragged", tmp_path)
    fa, fb = tmp_path / "a.h5", tmp_path / "b.h5"
    assert main(["featurize", str(path), "-o", str(fa), "-q"]) == 0
    assert main(["featurize", str(path), "-o", str(fb), "-q", "--device", DEV]) == 0
    capsys.readouterr()
    outs = []
    for f, dev in ((fa, "cpu"), (fb, DEV)):
        assert main(["certify", str(f), "--json", "-q", "--device", dev]) == 0
        outs.append(json.loads(capsys.readouterr().out))
    assert abs(outs[0]["lambda_min"] - outs[1]["lambda_min"]) <= 1e-12 * outs[0]["lambda_max"]
    ma, mb = tmp_path / "ma.h5", tmp_path / "mb.h5"
    assert main(["fit", str(fa), "-o", str(ma), "-q"]) == 0
    assert main(["fit", str(fb), "-o", str(mb), "-q", "--device", DEV]) == 0
    pa, pb = tmp_path / "pa.h5", tmp_path / "pb.h5"
    assert main(["predict", str(ma), str(path), "-o", str(pa), "-q"]) == 0
    assert main(["predict", str(mb), str(path), "-o", str(pb), "-q", "--device", DEV]) == 0
    with h5py.File(pa) as a, h5py.File(pb) as b:
        assert relerr(b["predictions"][...], a["predictions"][...]) < 1e-10


def test_without_torch_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                               capsys: pytest.CaptureFixture[str]) -> None:
    """No torch: any device but cpu exits 2 naming the gpu extra, before any work; cpu needs no torch."""
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    path, _ = _data("dense", tmp_path)
    for dev in ("cuda", "cuda:1", "torch:cpu"):
        with pytest.raises(InputError, match="gpu"):
            device_mod.check_device(dev)
    out = tmp_path / "f.h5"
    assert main(["featurize", str(path), "-o", str(out), "--device", "cuda", "-q"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "PyTorch" in err[0] and not out.exists()
    assert device_mod.check_device("cpu") is None and device_mod.check_device(None) is None
    assert main(["featurize", str(path), "-o", str(out), "--device", "cpu", "-q"]) == 0


@needs_torch
def test_workers_spread_over_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """'cuda' with several GPUs: the main thread takes cuda:0, worker threads one GPU each in turn."""
    import threading

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(device_mod, "_THREADS", {})
    assert device_mod.worker_device("cuda") == "cuda:0"
    assert device_mod.worker_device("cuda:2") == "cuda:2" and device_mod.worker_device(None) is None
    got: list[str] = []
    lock, alive = threading.Lock(), threading.Barrier(4)  # four threads alive at once (a pool's workers)

    def work() -> None:
        with lock:
            got.append(device_mod.worker_device("cuda"))
        alive.wait()
    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert got == ["cuda:0", "cuda:1", "cuda:2", "cuda:0"]
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert device_mod.worker_device("cuda") == "cuda"


@needs_torch
def test_device_equals_numpy_over_a_family() -> None:
    """Over random shapes, lengths, weights, chunkings and token scales (a rotated small-variance
    direction included), the device's statistics and certificate equal the numpy path's."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    @settings(max_examples=15, deadline=None, derandomize=True, suppress_health_check=list(HealthCheck))
    @given(d=st.integers(1, 4), n_seq=st.integers(1, 60), max_len=st.integers(1, 7), chunk=st.integers(1, 40),
           weighted=st.booleans(), small=st.sampled_from([1.0, 1e-3]), seed=st.integers(0, 2**16),
           normalize=st.sampled_from(["none", "length"]))
    def check(d, n_seq, max_len, chunk, weighted, small, seed, normalize):
        rng = np.random.default_rng(seed)
        lengths = rng.integers(1, max_len + 1, size=n_seq)
        off = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
        R = np.linalg.qr(rng.standard_normal((d, d)))[0] @ np.diag([small] + [1.0] * (d - 1))
        X = rng.standard_normal((int(off[-1]), d)) @ R
        Y = rng.standard_normal((n_seq, d))
        w = rng.uniform(0.5, 2.0, size=n_seq) if weighted else None
        parts = []
        for dev in (None, DEV):
            acc = accumulate.Accumulator(d, True, np.eye(d), normalize=normalize, device=dev)
            for a in range(0, n_seq, chunk):
                b = min(n_seq, a + chunk)
                acc.add(X[off[a]:off[b]], off[a:b + 1] - off[a], Y[a:b], weights=None if w is None else w[a:b])
            parts.append(acc.result())
        a, b = parts
        for k in ("basis_gram", "basis_moments", "target_gram", "basis_token_gram"):
            x, y = getattr(a, k), getattr(b, k)
            assert np.abs(x - y).max() <= 1e-12 * max(np.abs(x).max(), 1e-300), k
        ca, cb = certificate.certify_features(a.canonical()), certificate.certify_features(b.canonical(), device=DEV)
        assert ca.identifiable == cb.identifiable and ca.rank == cb.rank
        assert abs(ca.lambda_min - cb.lambda_min) <= 1e-10 * max(ca.lambda_max, 1e-300)

    check()


def _plane_data(tmp_path: Path, kind: str, d: int = 3, seed: int = 5) -> tuple[Path, np.ndarray, np.ndarray, dict]:
    """Ragged tokens with a small-variance rotated direction whose last tokens lie in a plane (the
    observed domain is smaller than the full one), in the layouts of KINDS."""
    rng = np.random.default_rng(seed)
    R = np.linalg.qr(rng.standard_normal((d, d)))[0] @ np.diag([1e-2] + [1.0] * (d - 1))
    off = np.concatenate([[0], np.cumsum(rng.integers(2, 9, size=300))]).astype(np.int64)
    X = rng.standard_normal((int(off[-1]), d)) @ R
    P = np.linalg.qr(rng.standard_normal((d, 2)))[0]
    X[off[1:] - 1] = (X[off[1:] - 1] @ P) @ P.T
    extra: dict = {}
    if kind == "per_position":  # the weighted prefixes end in the plane
        w = (rng.uniform(size=int(off[-1])) < 0.3) * 1.0
        w[off[1:] - 1] = 1.0
        X[w > 0] = (X[w > 0] @ P) @ P.T
        extra = {"targets": rng.standard_normal((int(off[-1]), d)), "weights": w}
    else:
        extra = {"targets": rng.standard_normal((300, d))}
    if kind == "weighted":
        extra["weights"] = rng.uniform(0.5, 2.0, size=300)
    return _write(tmp_path / f"{kind}.h5", tokens=X, offsets=off, **extra), X, off, extra


@pytest.mark.parametrize("kind", ["ragged", "per_position", "weighted", "length"])
@needs_torch
def test_device_certificates_equal_the_materialised_reference(kind: str, tmp_path: Path) -> None:
    """The device's full and observed certificates against plain numpy on materialised canonical
    features (tests/_reference.py), not against mhla's numpy path."""
    import _reference

    path, X, off, extra = _plane_data(tmp_path, kind)
    normalize = "length" if kind == "length" else "none"
    feats = stream.featurize(path, normalize=normalize, chunk_size=97, device=DEV)
    pp, w = kind == "per_position", extra.get("weights")
    ref = _reference.canonical(X, off, extra["targets"], per_position=pp, weights=w, normalize=normalize,
                               A=feats.basis)
    full = certificate.certify_features(feats, device=DEV)
    wr = ref["eigenvalues"]
    tol = wr.size * np.finfo(np.float64).eps * wr[-1]
    # Lambda~ = sum w Ht Ht^T / sum w in both (weights without units): the same scale
    scale = full.lambda_max / wr[-1]
    assert abs(scale - 1) <= 1e-10
    assert not full.identifiable and full.rank == int((wr > tol).sum())
    obs = certificate.certify_features(feats, domain="observed", device=DEV)
    wo, r, s = _reference.observed_eigenvalues(X, off, feats.basis, per_position=pp, weights=w,
                                               normalize=normalize)
    assert (obs.dim_tokens, obs.dim_last_tokens, obs.n_features) == (r, s, wo.size) == (3, 2, 12)
    assert obs.identifiable and obs.proof == "cholesky of Lambda~ - t I"
    assert abs(obs.lambda_min / obs.lambda_max - wo[0] / wo[-1]) <= 1e-9 * wo[0] / wo[-1]
    assert abs(obs.lambda_max / scale - wo[-1]) <= 1e-10 * wo[-1]
    # the fit on the device: the training predictions of the minimum-norm p against the reference's
    m = lstsq.fit(feats, device=DEV)
    seqs = [s_ for s_, _, _ in _reference.samples(X, off, pp, w)]
    keep = np.array([wi > 0 for _, wi, _ in _reference.samples(X, off, pp, w)])
    got = _reference.predict_own(m.coef, [q for q, k in zip(seqs, keep) if k], normalize)
    want = _reference.predict_canonical(_reference.min_norm_function(ref), ref["A"],
                                        [q for q, k in zip(seqs, keep) if k], normalize)
    assert _reference.ratio(got, want) <= 1e-8


@pytest.mark.parametrize("dense_max", [4096, 0], ids=["dense", "cholesky-lanczos"])
@needs_torch
def test_device_verdict_is_proven_by_a_shifted_cholesky(dense_max: int, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """On the device too: --min-eig at 0.5 x and 2 x the reference lambda_min is proven or refused by a
    Cholesky of Lambda~ - t I (torch.linalg), and a ridge below the tolerance gives the spectral ridge."""
    import _reference

    monkeypatch.setattr(factorization, "DENSE_MAX", dense_max)
    path, _ = _data("ragged", tmp_path)
    with h5py.File(path) as f:
        X, off, y = np.array(f["tokens"]), np.array(f["offsets"]), np.array(f["targets"])
    w = _reference.canonical(X, off, y)["eigenvalues"]
    for factor in (0.5, 2.0):
        feats = stream.featurize(path, device=DEV)
        c = certificate.certify_features(feats, min_eig=factor * w[0], device=DEV)
        assert c.identifiable is (factor < 1) and abs(c.lambda_min - w[0]) <= 1e-9 * w[0]
        assert c.proof == ("cholesky of Lambda~ - t I" if factor < 1 else "cholesky of Lambda~ - t I failed")
    # singular (N = 20 < psi = 40) with a ridge of 1e-30: the minimum-norm fit, not rounding / 1e-30
    n = 20
    feats = accumulate_range(inspect_tokens(path), (0, n), device=DEV)
    m = lstsq.fit(feats, ridge=1e-30, device=DEV)
    ref = _reference.canonical(X[:off[n]], off[:n + 1], y[:n])
    seqs = [X[a:b] for a, b in zip(off[:n], off[1:n + 1])]
    want = _reference.predict_canonical(_reference.min_norm_function(ref), ref["A"], seqs)
    assert _reference.ratio(_reference.predict_own(m.coef, seqs), want) <= 1e-8
