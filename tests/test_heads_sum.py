"""A layer as a sum of blocks of factored heads (mhla_cli.model.heads_sum): the sum against numpy, block by block
through output maps, the file (every piece checked), dense heads and the torch module."""

from __future__ import annotations

import h5py
import numpy as np
import pytest

from mhla_cli.errors import InputError
from mhla_cli.model.heads import Heads
from mhla_cli.model.heads_sum import HeadsSum, load_blocks, sum_of_blocks

BIDI = {"normalize": "length", "attention": "bidirectional"}


def _block(rng, D=5, r=2, e=3, H=2, info=BIDI):
    return Heads(V=rng.normal(size=(H, e, r)), Q=rng.normal(size=(H, r, r)), info=dict(info),
                 P=rng.normal(size=(D, r)), U=rng.normal(size=(e, e)) if e else np.eye(e))


def _numpy_block(h, X, off):
    """sum_h U V_h S~ Q_h x~_t at every position of each window, S~ of the whole window over its length."""
    out = np.zeros((X.shape[0], h.U.shape[0]))
    for a, b in zip(off[:-1], off[1:]):
        Z = X[a:b] @ h.P
        S = Z.T @ Z / (b - a)
        out[a:b] = np.einsum("ij,hjk,kl,hlm,tm->ti", h.U, h.V, S, h.Q, Z)
    return out


def _data(rng, n=12, D=5):
    lens = rng.integers(1, 6, size=n)
    off = np.concatenate([[0], np.cumsum(lens)])
    return rng.normal(size=(off[-1], D)), off


def test_predict_is_the_sum_of_the_blocks():
    rng = np.random.default_rng(0)
    parts = [_block(rng, r=2), _block(rng, r=3, H=1)]
    W, c = rng.normal(size=(3, 5)), rng.normal(size=3)
    s = HeadsSum(parts, affine_weight=W, affine_bias=c)
    X, off = _data(rng)
    ref = sum(_numpy_block(h, X, off) for h in parts) + X @ W.T + c
    assert np.allclose(s.predict(X, off), ref, rtol=1e-10, atol=1e-10)
    assert s.n_blocks == 2 and s.n_heads == 3 and (s.d, s.d_out) == (5, 3)
    assert "2 blocks" in repr(s)


def test_block_by_block_through_output_maps():
    """Each block fitted on its own e_b-dim targets (a head's output), its output map O_b (D_out, e_b) the head's
    columns of W_O: the sum is sum_b O_b (block b's prediction)."""
    rng = np.random.default_rng(1)
    parts = [_block(rng, e=2), _block(rng, e=2)]
    O = [rng.normal(size=(4, 2)) for _ in parts]
    s = sum_of_blocks(parts, O)
    X, off = _data(rng)
    ref = sum(_numpy_block(h, X, off) @ o.T for h, o in zip(parts, O))
    assert np.allclose(s.predict(X, off), ref, rtol=1e-10, atol=1e-10)
    assert s.d_out == 4 and s.info["fitted"] == "block by block"
    with pytest.raises(InputError, match="output map 1"):
        sum_of_blocks(parts, [O[0], np.ones((4, 3))])
    with pytest.raises(InputError, match="2 blocks but 1"):
        sum_of_blocks(parts, O[:1])
    with pytest.raises(InputError, match="not factored"):
        sum_of_blocks([Heads(V=np.ones((1, 2, 2)), Q=np.ones((1, 2, 2)))])


def test_the_blocks_must_agree():
    rng = np.random.default_rng(2)
    with pytest.raises(InputError, match="share the tokens"):
        HeadsSum([_block(rng, D=5), _block(rng, D=4)])
    with pytest.raises(InputError, match="normalisation or layout"):
        HeadsSum([_block(rng), _block(rng, info={"normalize": "none", "attention": "bidirectional"})])
    with pytest.raises(InputError, match="at least one"):
        HeadsSum([])
    with pytest.raises(InputError, match="together"):
        HeadsSum([_block(rng)], affine_weight=np.ones((3, 5)))
    with pytest.raises(InputError, match="affine map must be"):
        HeadsSum([_block(rng)], affine_weight=np.ones((3, 4)), affine_bias=np.ones(3))


def test_dense_heads_compute_the_same_function():
    rng = np.random.default_rng(3)
    s = HeadsSum([_block(rng, r=2), _block(rng, r=3)])
    dense = s.dense()
    X, off = _data(rng)
    other = HeadsSum([Heads(V=dense.V, Q=dense.Q, info=dense.info, P=np.eye(5), U=np.eye(3))])
    assert np.allclose(other.predict(X, off), s.predict(X, off), rtol=1e-9, atol=1e-9)
    with pytest.raises(InputError, match="affine"):
        HeadsSum(s.parts, affine_weight=np.ones((3, 5)), affine_bias=np.ones(3)).dense()


def test_file_round_trip(tmp_path):
    rng = np.random.default_rng(4)
    s = HeadsSum([_block(rng), _block(rng, r=3)], affine_weight=rng.normal(size=(3, 5)),
                 affine_bias=rng.normal(size=3), info={"fitted": "jointly", "ridge": 0.5})
    p = tmp_path / "b.h5"
    s.save(p)
    back = load_blocks(p)
    X, off = _data(rng)
    assert np.array_equal(back.predict(X, off), s.predict(X, off))
    assert back.info["fitted"] == "jointly" and back.info["ridge"] == 0.5
    assert back.layout.name == "bidirectional" and back.normalize == "length"


def _edit(p, fn):
    with h5py.File(p, "r+") as f:
        fn(f)


@pytest.mark.parametrize("edit, match", [
    (lambda f: f["V_1"].__setitem__((0, 0, 0), np.nan), "corrupted|NaN"),
    (lambda f: f["P_0"].__setitem__((0, 0), 7.0), "corrupted"),
    (lambda f: f.__delitem__("U_1"), "corrupted|incomplete|no 'U_1'"),
    (lambda f: f.__delitem__("affine_bias"), "corrupted|incomplete"),
    (lambda f: f.attrs.__setitem__("n_blocks", 1), "corrupted"),
    (lambda f: f.attrs.__setitem__("n_blocks", 3), "corrupted|incomplete"),
    (lambda f: f.attrs.__setitem__("normalize", "none"), "corrupted"),
])
def test_every_piece_of_the_file_is_checked(tmp_path, edit, match):
    rng = np.random.default_rng(5)
    s = HeadsSum([_block(rng), _block(rng)], affine_weight=rng.normal(size=(3, 5)), affine_bias=rng.normal(size=3))
    p = tmp_path / "b.h5"
    s.save(p)
    _edit(p, edit)
    with pytest.raises(InputError, match=match):
        load_blocks(p)


def test_truncated_and_foreign_files(tmp_path):
    rng = np.random.default_rng(6)
    p = tmp_path / "b.h5"
    HeadsSum([_block(rng)]).save(p)
    data = p.read_bytes()
    t = tmp_path / "t.h5"
    t.write_bytes(data[: len(data) // 2])
    with pytest.raises(InputError):
        load_blocks(t)
    h = tmp_path / "h.h5"
    _block(rng).save(h)
    with pytest.raises(InputError, match="heads|blocks"):
        load_blocks(h)


def test_torch_module_at_every_position_with_padding():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(7)
    s = HeadsSum([_block(rng), _block(rng, r=3)], affine_weight=rng.normal(size=(3, 5)),
                 affine_bias=rng.normal(size=3))
    X, off = _data(rng)
    ref = s.predict(X, off)
    lens = np.diff(off)
    n = int(lens.max())
    Xt = torch.zeros((lens.size, n, 5), dtype=torch.float64)
    mask = torch.zeros((lens.size, n))
    for i, (a, b) in enumerate(zip(off[:-1], off[1:])):
        Xt[i, : b - a] = torch.from_numpy(X[a:b])
        mask[i, : b - a] = 1
    with torch.no_grad():
        out = s.to_torch()(Xt, mask).numpy()
    for i, (a, b) in enumerate(zip(off[:-1], off[1:])):
        assert np.allclose(out[i, : b - a], ref[a:b], rtol=1e-10, atol=1e-10)
        assert np.all(out[i, b - a:] == 0)  # padding outputs 0
