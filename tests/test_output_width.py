"""Targets of any width D_out (a head's or a layer's own output beside d-dim tokens): featurize, fit, certify,
export-heads, predict and `to_torch` against plain numpy on materialised features (tests/_reference.py), and
metamorphic: an invertible map of the output coordinates maps the fit and leaves the certificate as it is."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import _reference as ref
from conftest import write_tokens
from mhla_cli import bias_terms as bias_mod
from mhla_cli.api.learn import RequestError, certify, export_heads, fit
from mhla_cli.cli import run
from mhla_cli.model.forward.evaluate import predict
from mhla_cli.samples import BIDIRECTIONAL
from mhla_cli.statistics.stream import featurize

D = 3
LSTSQ_TOL = 1e-8


def data(tmp_path: Path, e: int, per_position: bool = False, seed: int = 0, n: int = 150
         ) -> tuple[Path, np.ndarray, np.ndarray, np.ndarray]:
    """A tokens file of d = 3 tokens with targets `e` wide (a random function of the features, plus noise);
    (path, tokens, offsets, targets)."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(2 if per_position else 1, 8, n)
    off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    X = rng.standard_normal((int(off[-1]), D))
    smp = ref.samples(X, off, per_position, attention="bidirectional")
    H = np.stack([ref.features(Z) for Z, _, _ in smp])
    Y = H @ rng.standard_normal((e, H.shape[1])).T + 0.01 * rng.standard_normal((H.shape[0], e))
    path = write_tokens(tmp_path / f"w{e}.h5", X, off, Y)
    if per_position:
        import h5py

        with h5py.File(path, "a") as f:
            f.attrs["attention"] = "bidirectional"
    return path, X, off, Y


def lstsq_coef(X: np.ndarray, off: np.ndarray, Y: np.ndarray, per_position: bool = False,
               bias: bool = False) -> np.ndarray:
    """numpy's lstsq of the materialised own features H(X) -> Y: coef (D_out, psi)."""
    if bias:
        X, Y = bias_mod.with_constant(X), bias_mod.pad_targets(Y)
    smp = ref.samples(X, off, per_position, attention="bidirectional")
    H = np.stack([ref.features(Z) for Z, _, _ in smp])
    return np.linalg.lstsq(H, Y[[r for _, _, r in smp]], rcond=None)[0].T


@pytest.mark.parametrize("e", [1, D - 1, D + 3])
def test_fit_of_any_output_width_is_numpys_lstsq(tmp_path: Path, e: int) -> None:
    """featurize + fit equal numpy's lstsq of H(X) -> Y; the certificate is the one of the Gram, whatever D_out."""
    path, X, off, Y = data(tmp_path, e)
    feats = featurize(path)
    assert feats.d_out == feats.n_outputs == e and feats.basis_moments.shape[1] == e
    model = fit(feats)
    p = lstsq_coef(X, off, Y)
    assert model.coef.shape == (e, p.shape[1]) and model.W.shape == (e * D, D * D)
    assert ref.ratio(model.coef, p) <= LSTSQ_TOL
    square = featurize(data(tmp_path / "..", D)[0]) if e != D else feats
    a, b = certify(feats), certify(square)
    assert a.identifiable and abs(a.lambda_min - b.lambda_min) <= 1e-12 * b.lambda_min
    # R^2 over the D_out outputs
    pred = predict(model, X, off)
    resid = Y - pred
    r2 = 1.0 - (resid ** 2).sum() / ((Y - Y.mean(axis=0)) ** 2).sum()
    assert abs(model.info["train_r2"] - r2) <= 1e-9
    assert abs(model.info["train_mse"] - (resid ** 2).mean()) <= 1e-9 * (resid ** 2).mean()


@pytest.mark.parametrize("e", [1, D + 3])
def test_heads_predict_and_torch_reproduce_the_function(tmp_path: Path, e: int) -> None:
    """export-heads gives V_h (D_out, d) heads of the same function; predict of model and heads and to_torch
    equal the numpy forward H(X) p^T."""
    path, X, off, Y = data(tmp_path, e)
    model = fit(featurize(path))
    heads = export_heads(model)
    assert heads.V.shape[1:] == (e, D) and heads.Q.shape[1:] == (D, D)
    want = np.stack([ref.features(X[a:b]) for a, b in zip(off[:-1], off[1:])]) @ model.coef.T
    for fn in (model, heads):
        assert ref.ratio(predict(fn, X, off), want) <= 1e-10
    torch = pytest.importorskip("torch")
    module = heads.to_torch()
    out = np.stack([module(torch.as_tensor(X[a:b])).detach().numpy() for a, b in zip(off[:-1], off[1:])])
    assert ref.ratio(out, want) <= 1e-10


def test_bias_terms_with_another_output_width(tmp_path: Path) -> None:
    """The bias terms pad every target (y, 0): D_out + 1 outputs, the last exactly 0; the heads and their bias
    terms compute the fitted function."""
    path, X, off, Y = data(tmp_path, D + 2)
    model = fit(featurize(path, bias_terms=True))
    p = lstsq_coef(X, off, Y, bias=True)
    assert model.coef.shape[0] == D + 3 and not model.coef[-1].any()
    assert ref.ratio(model.coef, p) <= LSTSQ_TOL
    heads = export_heads(model)
    assert heads.V.shape[1:] == (D + 2, D) and heads.value_bias.shape[1] == D + 2
    want = np.stack([ref.features(bias_mod.with_constant(X[a:b])) for a, b in zip(off[:-1], off[1:])]) \
        @ model.coef.T
    assert ref.ratio(predict(heads, X, off), want[:, :-1]) <= 1e-9


def test_per_position_bidirectional_targets_of_another_width(tmp_path: Path) -> None:
    path, X, off, Y = data(tmp_path, D + 1, per_position=True, n=60)
    model = fit(featurize(path))
    assert ref.ratio(model.coef, lstsq_coef(X, off, Y, per_position=True)) <= LSTSQ_TOL
    _, outputs = predict(model, X, off, layout=BIDIRECTIONAL)
    smp = ref.samples(X, off, True, attention="bidirectional")
    want = np.stack([ref.features(Z) for Z, _, _ in smp]) @ model.coef.T
    assert ref.ratio(outputs, want) <= 1e-10
    # to_torch at every position of a padded batch: the D_out outputs of every unmasked position, 0 elsewhere
    torch = pytest.importorskip("torch")
    lens = np.diff(off)
    batch = torch.zeros((lens.size, int(lens.max()), D), dtype=torch.float64)
    mask = torch.zeros((lens.size, int(lens.max())))
    for i, (a, b) in enumerate(zip(off[:-1], off[1:])):
        batch[i, : b - a], mask[i, : b - a] = torch.as_tensor(X[a:b]), 1
    with torch.no_grad():
        out = export_heads(model).to_torch()(batch, layout=BIDIRECTIONAL, attention_mask=mask).numpy()
    assert out.shape[-1] == D + 1
    got = np.concatenate([out[i, : b - a] for i, (a, b) in enumerate(zip(off[:-1], off[1:]))])
    assert ref.ratio(got, want) <= 1e-10
    assert not any(out[i, b - a:].any() for i, (a, b) in enumerate(zip(off[:-1], off[1:])))


def test_an_invertible_map_of_the_outputs_maps_the_fit(tmp_path: Path) -> None:
    """Y -> Y M maps coef p to M^T p (the fit is linear in the targets) and leaves the certificate as it is."""
    path, X, off, Y = data(tmp_path, D + 2)
    M = np.random.default_rng(5).standard_normal((D + 2, D + 2)) + 3 * np.eye(D + 2)
    mapped = write_tokens(tmp_path / "mapped.h5", X, off, Y @ M)
    a, b = featurize(path), featurize(mapped)
    assert ref.ratio(fit(b).coef, M.T @ fit(a).coef) <= LSTSQ_TOL
    ca, cb = certify(a), certify(b)
    assert (ca.identifiable, ca.rank) == (cb.identifiable, cb.rank)
    assert abs(ca.lambda_min - cb.lambda_min) <= 1e-12 * ca.lambda_min


def test_low_rank_fits_of_another_width_are_refused(tmp_path: Path, capsys) -> None:
    path, *_ = data(tmp_path, D + 1)
    feats = featurize(path)
    for kw in ({"heads": 2}, {"nuclear": 0.1}):
        with pytest.raises(RequestError) as exc:
            fit(feats, **kw)
        assert exc.value.rule == "lowrank_width"
    with pytest.raises(RequestError) as exc:
        export_heads(fit(feats), fewest=True)
    assert exc.value.rule == "fewest_width"
    # the command line: one line naming the option, exit 2, before any work
    assert run(["fit", str(path), "-o", str(tmp_path / "m.h5"), "--heads", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--heads and --nuclear need targets as wide as the tokens" in err[0]


def test_predict_refuses_targets_of_another_width_than_the_models_outputs(tmp_path: Path, capsys) -> None:
    """A model of D_out outputs scored on targets of another width: one line, exit 2."""
    path, X, off, Y = data(tmp_path, D + 1)
    model_path = tmp_path / "m.h5"
    assert run(["fit", str(path), "-o", str(model_path)]) == 0
    other = write_tokens(tmp_path / "other.h5", X, off, Y[:, :2])
    capsys.readouterr()
    assert run(["predict", str(model_path), str(other), "-o", str(tmp_path / "p.h5")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "the targets are 2 wide but the model's outputs 4" in err[0]


def test_reduce_keep_targets_then_unreduce_is_the_fit_on_the_mapped_tokens(tmp_path: Path) -> None:
    """reduce keeping the targets (tokens X -> X P only), fit at the targets' full width, heads put back: on wide
    tokens they compute numpy's lstsq fit of H(X P) -> Y evaluated at X P."""
    from mhla_cli.model import reduce as reduce_mod

    rng = np.random.default_rng(3)
    n, wide, e = 150, 6, 5
    lens = rng.integers(1, 8, n)
    off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    Xw = rng.standard_normal((int(off[-1]), wide)) * np.linspace(2.0, 0.3, wide)
    Y = rng.standard_normal((n, e))
    path = write_tokens(tmp_path / "wide.h5", Xw, off, Y)
    out = tmp_path / "red.h5"
    red = reduce_mod.reduce_tokens(path, out, dim=D, keep_targets=True)
    assert red.U is None and red.keep_targets and reduce_mod.load_reduction(out).keep_targets
    import h5py

    with h5py.File(out) as f:
        assert np.array_equal(f["targets"][...], Y)  # copied unreduced
    model = fit(featurize(out))
    Z = Xw @ red.P
    p = lstsq_coef(Z, off, Y)
    assert model.coef.shape == (e, p.shape[1]) and ref.ratio(model.coef, p) <= LSTSQ_TOL
    heads = reduce_mod.unreduce_heads(export_heads(model), reduce_mod.load_reduction(out), out)
    want = np.stack([ref.features(Z[a:b]) for a, b in zip(off[:-1], off[1:])]) @ p.T
    assert ref.ratio(predict(heads, Xw, off), want) <= 1e-9
    # the command line: --keep-targets, then fit and export-heads --unreduce
    assert run(["reduce", str(path), "-o", str(tmp_path / "cli.h5"), "--dim", str(D), "--keep-targets"]) == 0
    assert run(["fit", str(tmp_path / "cli.h5"), "-o", str(tmp_path / "m.h5")]) == 0
    assert run(["export-heads", str(tmp_path / "m.h5"), "-o", str(tmp_path / "h.h5"), "--unreduce",
                str(tmp_path / "cli.h5")]) == 0
    assert run(["predict", str(tmp_path / "h.h5"), str(path), "-o", str(tmp_path / "p.h5")]) == 0
    with h5py.File(tmp_path / "p.h5") as f:
        assert ref.ratio(f["predictions"][...], want) <= 1e-9


def test_the_affine_block_with_targets_kept_at_full_width(tmp_path: Path) -> None:
    """reduce --keep-targets, then the fit with the affine block of the wide tokens: numpy's lstsq of
    [H(X P), x_wide, 1] -> Y at the targets' full width (the fitted values, unique whatever the coordinates)."""
    from mhla_cli.model import reduce as reduce_mod

    rng = np.random.default_rng(4)
    n, wide, e = 160, 6, 5
    lens = rng.integers(1, 8, n)
    off = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    Xw = rng.standard_normal((int(off[-1]), wide))
    Y = rng.standard_normal((n, e)) + Xw[off[1:] - 1] @ rng.standard_normal((wide, e))
    path = write_tokens(tmp_path / "wide.h5", Xw, off, Y)
    out = tmp_path / "red.h5"
    red = reduce_mod.reduce_tokens(path, out, dim=D, keep_targets=True)
    model = fit(featurize(out, affine_from=path))
    Z = Xw @ red.P
    F = np.stack([np.concatenate([ref.features(Z[a:b]), Xw[b - 1], [1.0]]) for a, b in zip(off[:-1], off[1:])])
    coef = np.linalg.lstsq(F, Y, rcond=None)[0]
    assert model.affine_coef.shape == (e, wide + 1)
    got = predict(model, Z, off, wide=Xw)
    assert ref.ratio(got, F @ coef) <= 1e-8


def test_statistics_of_different_output_widths_do_not_add(tmp_path: Path) -> None:
    from mhla_cli.errors import InputError

    a = featurize(data(tmp_path, 2)[0])
    b = featurize(data(tmp_path, 4)[0])
    with pytest.raises(InputError, match="cannot add statistics of targets (2 and 4|4 and 2) wide"):
        a + b


@pytest.mark.parametrize("bias", [False, True])
def test_tiled_statistics_of_another_width_fit_as_one_machine(client, tmp_path: Path, bias: bool) -> None:
    """The Gram tiled on a Dask cluster: the D_out-wide sums and the fit on the cluster are one machine's."""
    pytest.importorskip("dask.distributed")
    from mhla_cli.samples import ReadSpec
    from mhla_cli.statistics.distributed import tiled_statistics

    path, *_ = data(tmp_path, D + 2)
    stats = tiled_statistics.accumulate(path, client, chunk_size=23, read=ReadSpec(bias_terms=bias),
                                        tile_features=2 * (D + int(bias)))
    one = featurize(path, spans="off", bias_terms=bias)
    for k in ("target_gram", "target_sum"):
        assert ref.ratio(getattr(stats.sums, k), getattr(one, k)) <= 1e-12
    ridge = 1e-9 if bias else 0.0
    assert ref.ratio(fit(stats, ridge=ridge).coef, fit(one, ridge=ridge).coef) <= 1e-9


def test_a_zarr_store_of_another_width_round_trips(local, tmp_path: Path) -> None:
    """featurize on a cluster into a Zarr store: the D_out-wide moments read back (whole or tiled) are one
    machine's, and the fit of the store is numpy's lstsq."""
    pytest.importorskip("zarr")
    from mhla_cli.statistics.files.zarr_store import load_features

    cl, _ = local
    path, X, off, Y = data(tmp_path, D + 2)
    out = tmp_path / "f.zarr"
    assert run(["featurize", str(path), "--scheduler", cl.scheduler_address, "-o", str(out), "-q"]) == 0
    back, one = load_features(out), featurize(path, spans="off")
    for k in ("target_gram", "moments", "target_sum"):
        assert ref.ratio(getattr(back, k), getattr(one, k)) <= 1e-11, k
    assert ref.ratio(fit(back).coef, lstsq_coef(X, off, Y)) <= LSTSQ_TOL
    assert run(["fit", str(out), "-o", str(tmp_path / "m.h5"), "--scheduler", cl.scheduler_address, "-q"]) == 0


def test_a_model_of_another_width_compares_with_its_heads(tmp_path: Path) -> None:
    """compare: the model and its exported heads (V_h D_out x d) are one function; a truncation is another."""
    from mhla_cli.model.compare import function_distance

    path, *_ = data(tmp_path, D + 2)
    model = fit(featurize(path))
    assert function_distance(model, export_heads(model)).relative_distance <= 1e-12
    assert function_distance(model, export_heads(model, max_heads=1)).relative_distance > 1e-3


def test_the_estimator_fits_targets_of_any_width() -> None:
    """MHLA (scikit-learn style): D_out-wide targets give numpy's lstsq; later chunks keep the first's width."""
    from mhla_cli import MHLA
    from mhla_cli.errors import InputError

    rng = np.random.default_rng(0)
    seqs = [rng.standard_normal((int(rng.integers(1, 8)), D)) for _ in range(150)]
    Y = rng.standard_normal((150, D + 2))
    est = MHLA().fit(seqs, Y)
    H = np.stack([ref.features(s) for s in seqs])
    p = np.linalg.lstsq(H, Y, rcond=None)[0].T
    assert ref.ratio(est.predict(seqs), H @ p.T) <= LSTSQ_TOL
    with pytest.raises(InputError, match=r"targets have shape \(150, 2\), expected \(150, 5\)"):
        est.partial_fit(seqs, Y[:, :2])


def test_a_rollout_of_a_model_of_another_width_is_refused(tmp_path: Path, capsys) -> None:
    path, *_ = data(tmp_path, D + 2)
    assert run(["fit", str(path), "-o", str(tmp_path / "m.h5"), "-q"]) == 0
    capsys.readouterr()
    assert run(["rollout", str(tmp_path / "m.h5"), str(path), "-o", str(tmp_path / "r.h5"), "--steps", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "maps d = 3 tokens to 5-dim outputs" in err[0]
