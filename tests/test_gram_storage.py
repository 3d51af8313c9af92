"""The Gram's storages behind one interface (mhla_cli.statistics.storage.gram_storage): each one against the dense
numpy Gram of materialised features (tests/_reference.py), their algebra (sum, change of basis) equal across
storages, a features file round trip in each form, and a storage added as one module (a toy one, here)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

import _reference as ref
from _records import ragged_data
from conftest import write_tokens
from mhla_cli import certify, featurize, fit
from mhla_cli.errors import InputError
from mhla_cli.linalg import symgram
from mhla_cli.statistics.storage import gram_storage
from mhla_cli.statistics.features import Features
from mhla_cli.statistics.storage.gram_dense import DenseGram
from mhla_cli.statistics.storage.gram_pairs import PairsGram
from mhla_cli.statistics.accumulate import chunk_features
from mhla_cli.io import formats

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

    @classmethod
    def of_array(cls, G, q, r):
        return BoxGram(Box(np.array(G)))

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


# ---------------------------------------------------------------- a new file-backed storage is one module


class Tril:
    """What the toy file-backed storage holds: the lower triangle of the Gram, packed by rows."""

    def __init__(self, packed: np.ndarray, n: int) -> None:
        self.packed, self.n, self.shape = packed, n, (n, n)


def pack(G: np.ndarray) -> Tril:
    i, j = np.tril_indices(G.shape[0])
    return Tril(np.array(G[i, j], dtype=np.float64), G.shape[0])


def unpack(t: Tril) -> np.ndarray:
    i, j = np.tril_indices(t.n)
    G = np.zeros((t.n, t.n))
    G[i, j] = t.packed
    G[j, i] = t.packed
    return G


class TrilGram(gram_storage.GramStorage):
    """A toy file-backed storage, defined outside the package: the Gram as its packed lower triangle, in memory
    and in a features file (form "tril", the dataset 'basis_gram_tril'). Registering it is all it takes."""

    form = "tril"
    file_datasets = ("basis_gram_tril",)

    @classmethod
    def holds(cls, obj):
        return isinstance(obj, Tril)

    @classmethod
    def of_array(cls, G, q, r):
        return TrilGram(pack(G))

    def all_finite(self):
        return bool(np.isfinite(self.held.packed).all())

    def copy(self):
        return TrilGram(Tril(self.held.packed.copy(), self.held.n))

    def zeros_like(self):
        return TrilGram(Tril(np.zeros_like(self.held.packed), self.held.n))

    def add(self, other):
        return TrilGram(Tril(self.held.packed + pack(other.expand()).packed, self.held.n))

    def congruence(self, P, R, overwrite=False):
        M = np.kron(P, R)
        return TrilGram(pack(M @ unpack(self.held) @ M.T))

    def expand(self):
        return unpack(self.held)

    def pairs(self, q, r):
        return symgram.pairs_from_gram(self.expand(), q, r)

    def written(self, transform=None):
        return (self if transform is None else transform(self)).expand()

    @classmethod
    def file_data(cls, storage, q, r):
        return {"basis_gram_tril": pack(storage.expand()).packed}

    @classmethod
    def from_file(cls, f, path, q, r, block=False):
        n = q * r
        a = formats.read_array(f, "basis_gram_tril", path).astype(np.float64)
        if a.shape != (n * (n + 1) // 2,) or not np.isfinite(a).all():
            raise InputError(f"'basis_gram_tril' has shape {a.shape} or non-finite values, expected finite "
                             f"({n * (n + 1) // 2},)", path)
        return TrilGram(Tril(a, n))


@pytest.fixture
def tril(monkeypatch):
    """TrilGram registered for the test (the registry restored after it)."""
    monkeypatch.setattr(gram_storage, "_STORAGES", list(gram_storage.storages()))
    gram_storage.register(TrilGram)
    return TrilGram


@pytest.mark.parametrize("spans", ["off", "on"])
def test_a_file_backed_storage_registered_outside_the_package_runs_featurize_to_fit(tril, tmp_path: Path,
                                                                                  spans: str) -> None:
    """featurize -> save in the toy form -> load -> certify -> fit through TrilGram: the file holds its dataset
    only, the loaded record holds the toy storage, and the certificate and the fit equal the dense file's and
    numpy's on the materialised canonical features (tests/_reference.py)."""
    X, off, y = ragged_data(11, n=60, d=D)
    data = write_tokens(tmp_path / "d.h5", X, off, y)
    feats = featurize(data, spans=spans)
    feats.save(tmp_path / "dense.h5")
    feats.save(tmp_path / "tril.h5", form="tril")
    import h5py

    with h5py.File(tmp_path / "tril.h5", "r") as f:
        assert "basis_gram_tril" in f and "basis_gram" not in f and "gram" not in f
    dense, toy = Features.load(tmp_path / "dense.h5"), Features.load(tmp_path / "tril.h5")
    assert isinstance(toy.gram_storage, TrilGram) and isinstance(dense.gram_storage, DenseGram)
    r = ref.canonical(X, off, y, A=toy.basis)
    c_dense, c_toy = certify(dense), certify(toy)
    assert c_toy.identifiable and c_dense.identifiable
    assert abs(c_toy.lambda_min - r["eigenvalues"][0]) <= 1e-9 * r["eigenvalues"][-1]
    assert abs(c_toy.lambda_min - c_dense.lambda_min) <= 1e-12 * c_dense.lambda_max
    m_dense, m_toy = fit(dense), fit(toy)
    pb = ref.min_norm_function(r, rcond=None)
    assert ref.ratio(m_toy.coef_b, pb) < 1e-8
    assert ref.ratio(m_toy.coef, m_dense.coef) < 1e-10
    assert not toy.on_spans or spans == "on"
    if not toy.on_spans:  # the own gram, derived through the toy storage on load
        assert rel(toy.gram, dense.gram) < 1e-10
    toy.save(tmp_path / "again.h5", form="tril")  # written again from the toy storage
    assert rel(Features.load(tmp_path / "again.h5").gram_storage.expand(), dense.gram_storage.expand()) < 1e-12


def test_a_file_in_an_unregistered_form_is_not_read_as_another(tmp_path: Path, tril) -> None:
    """Written in the toy form, the file is refused once the toy storage is not registered (no storage claims
    its Gram), and saving in an unknown form names the registered ones."""
    X, off, y = ragged_data(12, n=50, d=D)
    feats = chunk_features(X, off, y, D)
    feats.save(tmp_path / "t.h5", form="tril")
    assert type(Features.load(tmp_path / "t.h5").gram_storage) is TrilGram
    gram_storage._STORAGES.remove(TrilGram)
    with pytest.raises(InputError, match="missing dataset 'gram'"):
        Features.load(tmp_path / "t.h5")
    with pytest.raises(InputError, match="unknown form 'tril'.*compact, full"):
        feats.save(tmp_path / "u.h5", form="tril")
    with pytest.raises(ValueError, match="registered already"):
        gram_storage.register(type("Other", (TrilGram,), {"form": "full"}))


# ---------------------------------------------------------------- every registered storage against the dense one


def seen(s: gram_storage.GramStorage, scale: float = 1.0) -> np.ndarray:
    """The Gram as the storage's own factorization sees it (G = inverse of its solve of I): no storage's
    `expand`, so a storage that never gathers (tiles) is observed the same way."""
    fac = s.factorization(scale=scale)
    inv = fac.solve(np.eye(s.n))
    assert inv is not None
    return np.linalg.inv(inv)


def _refuses_or(fn, check) -> None:
    """`check(fn())`, or, where the storage refuses the operation, a one-line InputError (never a wrong answer)."""
    try:
        out = fn()
    except InputError as exc:
        assert "\n" not in str(exc)
        return
    check(out)


@pytest.mark.parametrize("cls", [*gram_storage.storages(), TrilGram], ids=lambda c: c.__name__)
def test_every_registered_storage_against_the_dense_one(cls, tmp_path: Path, monkeypatch) -> None:
    """Each registered storage (and the toy one) made from the dense Gram: its factorization, sum, change of
    basis, distinct entries and features-file round trip equal the dense storage's."""
    if cls is TrilGram:
        monkeypatch.setattr(gram_storage, "_STORAGES", list(gram_storage.storages()))
        gram_storage.register(TrilGram)
    G1, G2 = gram(1), gram(2)
    dense1, dense2 = DenseGram.of_array(G1, Q, D), DenseGram.of_array(G2, Q, D)
    a, b = cls.of_array(G1, Q, D), cls.of_array(G2, Q, D)
    assert gram_storage.wrap(a.held) is not None and type(gram_storage.wrap(a.held)) is cls
    assert a.n == Q * D and a.all_finite()
    assert rel(seen(a, 1 / 40), seen(dense1, 1 / 40)) < 1e-9
    fa, fd = a.factorization(scale=1 / 40), dense1.factorization(scale=1 / 40)
    assert abs(fa.lambda_max() - fd.lambda_max()) <= 1e-9 * fd.lambda_max()
    w0 = float(np.linalg.eigvalsh(G1 / 40)[0])
    assert fa.proves_above(0.5 * w0) and not fa.proves_above(2.0 * w0)
    total = a.copy().add(b)
    assert rel(seen(total), seen(dense1.copy().add(dense2))) < 1e-9
    assert rel(seen(a), G1) < 1e-9  # the sum of a copy left the original alone
    rng = np.random.default_rng(3)
    P, R = np.eye(Q) + 0.1 * rng.standard_normal((Q, Q)), np.eye(D) + 0.1 * rng.standard_normal((D, D))
    _refuses_or(lambda: a.copy().congruence(P, R),
                lambda c: rel(c.expand(), dense1.copy().congruence(P, R).expand()) < 1e-12)
    _refuses_or(lambda: a.pairs(Q, D), lambda K: rel(K, dense1.pairs(Q, D)) < 1e-12)
    if cls.form is None:  # not written to a features file
        return
    X, off, y = ragged_data(7, n=50, d=D)
    feats = chunk_features(X, off, y, D)
    feats.basis_gram = cls.of_array(feats.basis_gram, Q, D)
    feats.save(tmp_path / "f.h5", form=cls.form)
    back = Features.load(tmp_path / "f.h5")
    assert type(back.gram_storage) is cls
    r = ref.canonical(X, off, y, A=back.basis)
    assert rel(seen(back.gram_storage), r["lambda"] * r["W"]) < 1e-9


@pytest.mark.parametrize("form", ["full", "compact", "tril"])
def test_a_load_counts_what_the_form_reads_beside_the_gram(tril, tmp_path: Path, monkeypatch, form: str) -> None:
    """The memory a load is checked for (features_file.expect_features -> memory.check_load) counts the form's
    datasets beside the expanded Gram: none for the full array, the distinct entries or the packed triangle
    read and then expanded."""
    import h5py

    from mhla_cli.statistics.files import features_file

    X, off, y = ragged_data(13, n=50, d=D)
    chunk_features(X, off, y, D).save(tmp_path / "f.h5", form=form)
    asked = []
    monkeypatch.setattr(features_file, "check_load", lambda d, block, extra, path: asked.append(extra))
    with h5py.File(tmp_path / "f.h5", "r") as f:
        features_file.expect_features(f, tmp_path / "f.h5")
        n = Q * D
        want = {"full": 0, "compact": 8 * int(np.prod(f["basis_gram_pairs"].shape)) if form == "compact" else 0,
                "tril": 8 * n * (n + 1) // 2}[form]
    assert asked == [want] and (want > 0) == (form != "full")
