"""The Gram's storages behind one interface (mhla_cli.statistics.storage.gram_storage): each one against the dense
numpy Gram of materialised features (tests/_reference.py), their algebra (sum, change of basis) equal across
storages, a features file round trip in each form, and a storage added as one module (a toy one, here)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import _reference as ref
from _records import ragged_data
from mhla_cli.errors import InputError
from mhla_cli.linalg import symgram
from mhla_cli.statistics.storage import gram_storage
from mhla_cli.statistics.features import Features
from mhla_cli.statistics.storage.gram_dense import DenseGram
from mhla_cli.statistics.storage.gram_pairs import PairsGram
from mhla_cli.statistics.accumulate import chunk_features

D = 3
Q = D * (D + 1) // 2


def rows(seed: int, n: int = 40) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Materialised canonical features of n random sequences: the rows Ht (n, q d)
    (tests/_reference.canonical_features) and their factors s (n, q) (S[j, j], sqrt 2 S[j, k]) and x_n (n, d)."""
    X, off, _ = ragged_data(seed, n=n, d=D)
    seqs = [X[a:b] for a, b in zip(off[:-1], off[1:])]
    j, k = np.triu_indices(D)
    s = np.stack([(z.T @ z)[j, k] * np.where(j == k, 1.0, np.sqrt(2.0)) for z in seqs])
    return np.stack([ref.canonical_features(z) for z in seqs]), s, np.stack([z[-1] for z in seqs])


def gram(seed: int) -> np.ndarray:
    Ht, _, _ = rows(seed)
    return Ht.T @ Ht


def storages_of(seed: int) -> dict[str, gram_storage.GramStorage]:
    """The same Gram in each in-memory storage, each made its own way: the array of the materialised rows,
    and the distinct entries accumulated by symgram.SymGram from the factors (never from the array)."""
    Ht, s, x = rows(seed)
    acc = symgram.SymGram(Q, D)
    acc.add(np.ascontiguousarray(s.T), np.ascontiguousarray(x.T))
    return {"dense": gram_storage.wrap(Ht.T @ Ht), "pairs": gram_storage.wrap(symgram.Pairs(acc.K, Q, D))}


def rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_each_storage_holds_the_materialised_gram() -> None:
    G = gram(0)
    st = storages_of(0)
    assert isinstance(st["dense"], DenseGram) and isinstance(st["pairs"], PairsGram)
    for name, s in st.items():
        assert s.n == Q * D and s.all_finite(), name
        assert rel(s.expand(), G) < 1e-13, name
        K = s.pairs(Q, D)
        assert rel(symgram.gram_from_pairs(K, Q, D), G) < 1e-13, name


def test_sum_and_change_of_basis_agree_across_storages_and_with_numpy() -> None:
    """a + b, and kron(P, R) G kron(P, R)^T for square and for narrowing factors (the spans' block):
    every storage gives the numpy answer, and the storage keeps its form."""
    rng = np.random.default_rng(5)
    G1, G2 = gram(1), gram(2)
    P, R = rng.standard_normal((Q, Q)), rng.standard_normal((D, D))
    Pn, Rn = np.linalg.qr(rng.standard_normal((Q, 4)))[0].T, np.linalg.qr(rng.standard_normal((D, 2)))[0].T
    for name in ("dense", "pairs"):
        a, b = storages_of(1)[name], storages_of(2)[name]
        total = a.add(b)
        assert type(total) is type(a) and rel(total.expand(), G1 + G2) < 1e-13, name
        for PP, RR, overwrite in ((P, R, False), (P, R, True), (Pn, Rn, True)):
            src = storages_of(1)[name]
            before = src.expand().copy()
            out = src.congruence(PP, RR, overwrite=overwrite)
            M = np.kron(PP, RR)
            assert type(out) is type(src) and out.n == PP.shape[0] * RR.shape[0], name
            assert rel(out.expand(), M @ G1 @ M.T) < 1e-12, (name, overwrite)
            if not overwrite:
                assert np.array_equal(src.expand(), before), name  # the source unchanged


def test_unlike_forms_add_as_arrays() -> None:
    G1, G2 = gram(1), gram(2)
    for a, b in (("dense", "pairs"), ("pairs", "dense")):
        out = storages_of(1)[a].add(storages_of(2)[b])
        assert rel(out.expand(), G1 + G2) < 1e-13, (a, b)


def test_copy_and_zeros_like_are_independent() -> None:
    for name, s in storages_of(3).items():
        c = s.copy()
        z = s.zeros_like()
        assert type(c) is type(s) and type(z) is type(s) and not z.expand().any(), name
        c.add(storages_of(4)[name])
        assert rel(s.expand(), gram(3)) < 1e-13, name  # the copy's sum left the original alone


def test_wrap_picks_the_storage_and_refuses_other_objects() -> None:
    s = storages_of(0)["dense"]
    assert gram_storage.wrap(None) is None and gram_storage.wrap(s) is s
    assert {DenseGram, PairsGram} <= set(gram_storage.storages())
    with pytest.raises(TypeError, match="no Gram storage"):
        gram_storage.wrap([[1.0]])


def test_factorization_of_each_storage_is_of_its_gram() -> None:
    lam = gram(0) / 40
    want = np.linalg.eigvalsh(lam)
    for name, s in storages_of(0).items():
        fac = s.factorization(scale=1.0 / 40)
        assert rel(fac.eigenvalues(), want) < 1e-12, name


def test_the_own_gram_is_the_gram_of_the_own_features_and_overflow_is_refused() -> None:
    """own_of: from the canonical Gram of the tokens X A back to the Gram of the features of X (materialised,
    tests/_reference.py), in each storage's form; a basis whose inverse overflows the Gram is refused."""
    X, off, _ = ragged_data(6, n=40, d=D)
    A = np.linalg.qr(np.random.default_rng(6).standard_normal((D, D)))[0] * np.array([0.5, 2.0, 3.0])
    seqs = [X[a:b] for a, b in zip(off[:-1], off[1:])]
    Ht = np.stack([ref.canonical_features(z @ A) for z in seqs])
    H = np.stack([ref.features(z) for z in seqs])
    Gb = Ht.T @ Ht
    for s in (gram_storage.wrap(Gb), gram_storage.wrap(symgram.Pairs(symgram.pairs_from_gram(Gb, Q, D), Q, D))):
        own = gram_storage.own_of(s, A)
        assert type(own) is type(s) and rel(own.expand(), H.T @ H) < 1e-11, type(s).__name__
        with pytest.raises(InputError, match="overflow float64"):
            gram_storage.own_of(s, 1e-120 * np.eye(D))


@pytest.mark.parametrize("accumulate_on_k", [True, False])
@pytest.mark.parametrize("compact", [True, False])
def test_features_file_round_trip_in_each_form(monkeypatch, tmp_path: Path, accumulate_on_k: bool,
                                               compact: bool) -> None:
    """Statistics held as an array or as distinct entries, written in the full or the compact form: read back,
    the storage is the file's form, and its Gram is the materialised canonical Gram of the data."""
    monkeypatch.setattr(symgram, "SYMGRAM_MIN_D", 1 if accumulate_on_k else 10**9)
    X, off, y = ragged_data(7, n=50, d=D)
    feats = chunk_features(X, off, y, D)
    assert isinstance(feats.gram_storage, PairsGram if accumulate_on_k else DenseGram)
    feats.save(tmp_path / "f.h5", compact=compact)
    back = Features.load(tmp_path / "f.h5")
    assert isinstance(back.gram_storage, PairsGram if compact else DenseGram)
    r = ref.canonical(X, off, y, A=back.basis)
    assert rel(back.gram_storage.expand(), r["lambda"] * r["W"]) < 1e-11
    assert rel(back.gram, feats.gram) < 1e-12  # the own gram, derived through the storage


# ---------------------------------------------------------------- a new storage is one module


class Box:
    """What a new storage holds (here: an array in a box)."""

    def __init__(self, a: np.ndarray) -> None:
        self.a = a
        self.shape = a.shape


class BoxGram(gram_storage.GramStorage):
    """A toy storage: everything through the boxed array. Registering it is all a record needs."""

    dataset = None

    @classmethod
    def holds(cls, obj):
        return isinstance(obj, Box)

    def all_finite(self):
        return bool(np.isfinite(self.held.a).all())

    def copy(self):
        return BoxGram(Box(self.held.a.copy()))

    def zeros_like(self):
        return BoxGram(Box(np.zeros_like(self.held.a)))

    def add(self, other):
        return BoxGram(Box(self.held.a + other.expand()))

    def congruence(self, P, R, overwrite=False):
        M = np.kron(P, R)
        return BoxGram(Box(M @ self.held.a @ M.T))

    def expand(self):
        return self.held.a

    def pairs(self, q, r):
        return symgram.pairs_from_gram(self.held.a, q, r)

    def written(self, transform=None):
        return (self if transform is None else transform(self)).held.a


def test_a_registered_storage_carries_the_record(monkeypatch) -> None:
    """A storage defined outside the package and registered: a record holds it, its change of basis, sum
    and solver statistics go through it, and they equal those of the dense record."""
    monkeypatch.setattr(gram_storage, "_STORAGES", list(gram_storage.storages()))
    gram_storage.register(BoxGram)
    monkeypatch.setattr(symgram, "SYMGRAM_MIN_D", 10**9)
    X, off, y = ragged_data(8, n=50, d=D)
    X2, off2, y2 = ragged_data(9, n=30, d=D, scale=np.array([1.0, 0.1, 5.0]))
    plain = [chunk_features(X, off, y, D, basis="identity"), chunk_features(X2, off2, y2, D, basis="identity")]
    boxed = [f.copy() for f in plain]
    for f in boxed:
        f.basis_gram = Box(np.array(f.basis_gram_held))
        assert isinstance(f.gram_storage, BoxGram)
    total_p, total_b = plain[0] + plain[1], boxed[0] + boxed[1]
    assert isinstance(total_b.gram_storage, BoxGram)  # the empty sum adopted the part's form
    _, gp, mp = total_p.solver_stats()
    _, gb, mb = total_b.solver_stats()
    assert rel(gb, gp) < 1e-12 and rel(mb, mp) < 1e-12


def test_a_file_holding_two_forms_is_refused(tmp_path: Path) -> None:
    import h5py

    X, off, y = ragged_data(7, n=50, d=D)
    chunk_features(X, off, y, D).save(tmp_path / "f.h5", compact=True)
    with h5py.File(tmp_path / "f.h5", "r+") as f:
        f["basis_gram"] = np.eye(Q * D)
    with pytest.raises(InputError, match="has both 'basis_gram' and 'basis_gram_pairs'"):
        Features.load(tmp_path / "f.h5")
