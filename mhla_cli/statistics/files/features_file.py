"""The features file: `Features.save` / `Features.load` (formats 1-5, the compact form) and their refusals.

docs/formats_features.md describes the file. `FeaturesFile` is mixed into mhla_cli.statistics.features.Features
(which imports this module; the record's fields are declared for the type checker by the base
mhla_cli.statistics.record_fields.FeaturesFields, and `load` returns `Self`): `datasets` and
`file_attrs` lay the record out, `load` reads and validates a file of any format version (1: own sums
only; 2: basis sums in upper-triangle coordinates, converted; 3: canonical basis sums; 4: may hold
only the block on the data's spans; 5: the weight totals, and the compact form). The own psi x psi 'gram' of a file is validated
on load and read when first used (`StoredGram`); `expect_features` refuses up front a file whose
statistics cannot fit in memory (the policy: mhla_cli.linalg.memory.check_load).
"""

from __future__ import annotations

import json
import os
from typing import Any, Self

import h5py
import numpy as np

from mhla_cli.statistics import basis as basis_mod
from mhla_cli.io import formats
from mhla_cli.linalg.memory import check_load
from mhla_cli.errors import InputError
from mhla_cli.feature_map import n_features
from mhla_cli.numerics import ORTHONORMAL_TOL, SINGULAR_BASIS_COND
from mhla_cli.io.formats import read_normalize
from mhla_cli.samples import ReadSpec, from_attrs
from mhla_cli.statistics.storage import gram_storage
from mhla_cli.statistics.affine_sums import read_affine
from mhla_cli.statistics.record_fields import FeaturesFields

# The sums on the tokens' own features (datasets of docs/formats_features.md), and those in the basis.
SUMS = ("gram", "moments", "target_gram", "token_gram", "last_token_gram")
BASIS_SUMS = ("basis_gram", "basis_moments", "basis_token_gram", "basis_last_token_gram")
# Attributes of a features file kept in `Features.extra_attrs` when it is loaded: which shard of
# the source it holds, for a partial merge the sample ranges it covers (JSON), and how featurize
# reached the whitening of the data (passes over the tokens, cond of the estimate's correction), and
# the passes spent finding the data's spans (stream.find_spans; 0: none).
EXTRA_ATTRS = ("shard", "sample_ranges", "partial", "basis_passes", "basis_correction_cond", "span_passes")
# mhla format version from which basis_gram / basis_moments are canonical (orthonormal coordinates,
# basis = the whitening of the file's own token Gram); version 2 stored upper-triangle coordinates.
CANONICAL_FORMAT = 3
# mhla format version from which features files hold the weight totals (attributes weight_sum =
# sum w and token_weight_sum = sum w n: Lambda~ and G carry no units of the weights).
WEIGHTS_FORMAT = 5
WEIGHT_ATTRS = ("weight_sum", "token_weight_sum")
# The forms of the canonical Gram in a features file (the `form` of a storage,
# mhla_cli.statistics.storage.gram_storage): "full" by default, "compact" with `compact=True` (its
# distinct entries only, from format version 5: mhla_cli.statistics.storage.gram_pairs).
FULL_FORM = "full"
COMPACT_FORM = "compact"


class FeaturesFile(FeaturesFields):
    """The file of a `Features` record (mixed into it): its layout, `save` and `load`."""

    def datasets(self, compact: bool = False, form: str | None = None
                 ) -> dict[str, np.ndarray | formats.Deferred | None]:
        """The datasets of a features file (docs/formats_features.md). The canonical Gram is written by the
        storage of `form` (mhla_cli.statistics.storage.gram_storage.file_form: "full", 'basis_gram' beside the
        own 'gram'; `compact`: "compact", its distinct entries only; or a registered storage's form). The
        psi x psi ones are `formats.Deferred`: derived from the held form when written, one at a time, and
        not kept."""
        writer = gram_storage.file_form(form if form is not None else COMPACT_FORM if compact else FULL_FORM)
        self.finalize()
        self.canonical()
        own = self._gram_raw  # None for a block on the data's spans
        data = {"gram": None if not writer.own_gram_in_file or own is None else own if isinstance(own, np.ndarray)
                else self._own_gram_to_write(),
                "moments": self.moments, "target_gram": self.target_gram,
                "token_gram": self.token_gram, "last_token_gram": self.last_token_gram}
        data.update(basis=self.basis, **{k: getattr(self, k) for k in self.BASIS_SUMS if k != "basis_gram"})
        data["basis_gram"] = None  # the basis Gram as the storage of the form writes it
        storage = self.gram_storage
        if storage is not None:
            data.update(writer.file_data(storage, *self.factor_sizes()))
        data.update(span_pairs=self.span_pairs, span_last=self.span_last)  # None (not written) unless reduced
        data["target_sum"] = self.target_sum  # None (not written) when unknown
        if self.affine is not None:  # the affine block (mhla_cli.statistics.affine_sums)
            data.update(self.affine.datasets())
        return data

    def _own_gram_to_write(self) -> formats.Deferred | np.ndarray:
        """The own gram for the file, made when written: derived from the basis Gram through its storage
        (from distinct entries a block of rows at a time, never held whole), or read if stored; not kept."""
        if self._gram_raw is DERIVED:
            storage, A = self.gram_storage, self.basis
            assert storage is not None and A is not None, "a gram derived from the basis sums has them"
            return storage.written(lambda g: gram_storage.own_of(g, A))
        n = self.n_features
        return formats.Deferred(lambda: self.gram, 8 * n * n)

    def save(self, path: str | os.PathLike, inputs: tuple[str | os.PathLike, ...] = (),
             extra: dict[str, np.ndarray] | None = None, extra_attrs: dict[str, Any] | None = None,
             compact: bool = False, form: str | None = None) -> None:
        """Write a features file atomically (`extra` datasets and attributes beside, e.g. per-fold sums);
        `compact`: the Gram as its distinct entries only; `form`: the Gram in a registered storage's form
        (`datasets`)."""
        formats.write_file(path, "features", {**self.datasets(compact, form), **(extra or {})},
                           {**self.file_attrs(), **(extra_attrs or {})}, inputs)

    def factor_sizes(self) -> tuple[int, int]:
        """(q, r): the lengths of the pair factor and of the token factor of the basis features
        (d(d+1)/2 and d; the spans' widths for a block), for mhla_cli.linalg.symgram."""
        if self.on_spans:
            E, F = self.span_pairs, self.span_last
            assert E is not None and F is not None, "a block on the spans holds both of them (on_spans)"
            return int(E.shape[1]), int(F.shape[1])
        return n_features(self.d) // self.d, self.d

    def file_attrs(self) -> dict[str, Any]:
        """The attributes of a features file (docs/formats_features.md)."""
        attrs: dict[str, Any] = {"d": self.d, "n_samples": self.n_samples, "n_tokens": self.n_tokens,
                                 "n_features": self.n_features, "token_dtype": self.token_dtype,
                                 "weight_sum": self.weight, "token_weight_sum": self.token_weight}
        if self.sample_range is not None:
            attrs["sample_lo"], attrs["sample_hi"] = self.sample_range
        if self.source is not None:
            attrs["source"] = json.dumps(self.source)
        attrs["normalize"] = self.normalize
        attrs.update(self.samples.attrs())  # per_position, and attention for per-position samples
        if self.bias_terms:  # written only with them (absent: the tokens without a constant coordinate)
            attrs["bias_terms"] = 1
        if self.affine is not None:
            attrs.update(self.affine.attrs())
        if self.n_sequences is not None:
            attrs["n_sequences"] = int(self.n_sequences)
        attrs.update(self.extra_attrs)
        return attrs

    @classmethod
    def load(cls, path: str | os.PathLike, part: bool = False) -> Self:
        """Read and validate a features file. `part`: it may be an empty part (a shard or fold whose weights are
        all 0: no samples, zero sums), which adds nothing (`merge`); otherwise a file without samples is refused."""
        with formats.open_input(path) as f:
            expect_features(f, path)
            d = formats.read_attr_int(f, "d", path)
            n = formats.read_attr_int(f, "n_samples", path)
            t = formats.read_attr_int(f, "n_tokens", path)
            psi = n_features(d)
            reduced = "span_pairs" in f or "span_last" in f  # only the block on the data's spans
            # a file whose form holds no own gram: derived from the basis sums when used (`finalize`)
            stored = gram_storage.file_storage(f, path)
            gram = None if reduced else _stored_gram(f, path, d, psi) if stored is None or stored.own_gram_in_file \
                else DERIVED
            tg = formats.read_array(f, "token_gram", path).astype(np.float64)
            lg = formats.read_array(f, "last_token_gram", path).astype(np.float64)
            for name, arr in (("token_gram", tg), ("last_token_gram", lg)):
                if arr.shape != (d, d):
                    raise InputError(f"'{name}' has shape {arr.shape}, expected ({d}, {d})", path)
            moments = target_gram = None
            e = _out_width(f, path, d)  # the targets' width D_out (the moments' columns)
            if "moments" in f and not reduced:
                moments = formats.read_array(f, "moments", path).astype(np.float64, copy=False)
                if moments.shape != (psi, e):
                    raise InputError(f"'moments' has shape {moments.shape}, expected ({psi}, {e})", path)
            has_targets = "basis_moments" in f if reduced else moments is not None
            if has_targets:
                if "target_gram" not in f:
                    raise InputError("has moments but no 'target_gram'", path)
                target_gram = formats.read_array(f, "target_gram", path).astype(np.float64)
                if target_gram.shape != (e, e):
                    raise InputError(f"'target_gram' has shape {target_gram.shape}, expected ({e}, {e})", path)
            if n < 1 and not (part and n == 0):
                raise InputError(f"n_samples = {n}: no samples", path)
            rng = None
            if "sample_lo" in f.attrs and "sample_hi" in f.attrs:
                rng = (int(f.attrs["sample_lo"]), int(f.attrs["sample_hi"]))
            source = json.loads(f.attrs["source"]) if "source" in f.attrs else None
            sums = _load_basis(f, path, d, has_targets, tg, lg, stored, e) if not reduced \
                else _load_block(f, path, d, has_targets, stored, e)
            dtype = f.attrs.get("token_dtype", "float64")
            dtype = dtype.decode() if isinstance(dtype, bytes) else str(dtype)
            normalize = read_normalize(f, path)
            samples = from_attrs(f.attrs, path)
            bias_terms = formats.read_bias_terms(f.attrs, path)
            if bias_terms and d < 2:
                raise InputError(f"attribute 'bias_terms' is 1 but d = {d}: the tokens (x, 1) are at least 2 wide; "
                                 "the file is corrupted", path)
            n_seq = int(f.attrs["n_sequences"]) if "n_sequences" in f.attrs else None
            spans = [f[k].shape for k in ("span_pairs", "span_last") if k in f]
            nf = int(spans[0][1] * spans[1][1]) if reduced and len(spans) == 2 and all(len(s) == 2 for s in spans) \
                else psi
            affine = read_affine(f, path, nf, e if has_targets else None)
            t_sum = _load_target_sum(f, path, e) if has_targets else None
            weights = _load_weights(f, path, n, t, samples.per_position, n_seq, empty=n == 0)
            extra = {}
            for k in EXTRA_ATTRS:
                if k in f.attrs:
                    v = f.attrs[k]
                    extra[k] = v.decode() if isinstance(v, bytes) else (v.item() if hasattr(v, "item") else v)
        return cls(d=d, n_samples=n, n_tokens=t, gram=gram, token_gram=tg, last_token_gram=lg,
                   moments=moments, target_gram=target_gram, token_dtype=dtype, sample_range=rng,
                   source=source, extra_attrs=extra, read=ReadSpec(samples, normalize, bias_terms),
                   n_sequences=n_seq, target_sum=t_sum, weight_sum=weights[0],
                   token_weight_sum=weights[1], affine=affine, **sums)


def expect_features(f: h5py.File, path: str | os.PathLike) -> None:
    """An InputError unless `f` is a features file whose statistics fit in memory, checked before
    anything large is read (what a load holds: mhla_cli.linalg.memory.check_load)."""
    formats.expect_kind(f, path, "features")
    if "d" in f.attrs:
        d = formats.read_attr_int(f, "d", path)
        # a form other than the full array: its datasets are read, then expanded
        stored = gram_storage.file_storage(f, path)
        check_load(d, formats.stored_block(f), 0 if stored is None else stored.load_bytes(f), path)


def _out_width(f: h5py.File, path: str | os.PathLike, d: int) -> int:
    """The targets' width D_out: the columns of 'moments' (or of 'basis_moments'); d without targets."""
    for name in ("moments", "basis_moments"):
        if name in f and isinstance(f[name], h5py.Dataset):
            shape = f[name].shape
            if len(shape) != 2 or shape[1] < 1:
                raise InputError(f"'{name}' has shape {shape}, expected (psi, D_out) with D_out >= 1", path)
            return int(shape[1])
    return d


def _load_target_sum(f: h5py.File, path: str | os.PathLike, d: int) -> np.ndarray | None:
    """target_sum (D_out,), validated; None in files without it."""
    if "target_sum" not in f:
        return None
    s = formats.read_array(f, "target_sum", path).astype(np.float64)
    if s.shape != (d,):
        raise InputError(f"'target_sum' has shape {s.shape}, expected ({d},)", path)
    if not np.isfinite(s).all():
        raise InputError("'target_sum' contains NaN or Inf; the file is corrupted", path)
    return s


def _load_weights(f: h5py.File, path: str | os.PathLike, n: int, t: int, per_position: bool,
                  n_seq: int | None, empty: bool = False) -> tuple[float, float]:
    """(weight_sum, token_weight_sum) of a features file (format >= WEIGHTS_FORMAT), or of an older one
    converted: unweighted last-token data have the counts; the others are refused (their totals
    cannot be told from the file). `empty`: a part without samples, whose totals are 0."""
    version = int(f.attrs.get("mhla_format_version", 2))
    have = [k for k in WEIGHT_ATTRS if k in f.attrs]
    if version < WEIGHTS_FORMAT and not have:
        if per_position or (n_seq is not None and n_seq != n):
            what = "per-position" if per_position else "weighted"
            raise InputError(f"holds {what} statistics of format version {version}, before the weight totals "
                             f"(version {WEIGHTS_FORMAT}); run `mhla featurize` on its tokens file again", path)
        return float(n), float(t)
    if len(have) < len(WEIGHT_ATTRS):
        missing = [k for k in WEIGHT_ATTRS if k not in have]
        raise InputError(f"has no attribute {', '.join(repr(k) for k in missing)}; the file is incomplete", path)
    out = []
    for k in WEIGHT_ATTRS:
        v = f.attrs[k]
        try:
            x = float(np.asarray(v).reshape(()))
        except (TypeError, ValueError):
            raise InputError(f"attribute '{k}' = {formats.value_text(v)} is not a number", path) from None
        if empty and x != 0:
            raise InputError(f"attribute '{k}' = {x!r} but n_samples = 0: expected 0; the file is corrupted", path)
        if not np.isfinite(x) or x <= 0 and not empty:
            raise InputError(f"attribute '{k}' = {x!r}, expected a finite number > 0", path)
        out.append(x)
    return out[0], out[1]


def _load_basis(f: h5py.File, path: str | os.PathLike, d: int, has_targets: bool, tg: np.ndarray,
                lg: np.ndarray, stored: type[gram_storage.GramStorage] | None, e: int) -> dict[str, Any]:
    """The basis and its canonical sums (moments of targets `e` wide); {} for version-1 files (`ensure_basis` derives
    them).

    Version-2 files stored basis_gram / basis_moments in upper-triangle coordinates and no basis token
    Grams: they are converted here (D gram D, D moments; A^T G A).
    """
    names = [k for k in ("basis", *BASIS_SUMS) if k in f]
    if not names:
        return {}
    version = int(f.attrs.get("mhla_format_version", 2))
    held = ["basis_gram"] if stored is None else list(stored.file_datasets)  # the Gram's datasets, by its storage
    names += [k for k in held if k not in names and k in f]
    need = ["basis", *held] + (["basis_moments"] if has_targets else [])
    if version >= CANONICAL_FORMAT:
        need += ["basis_token_gram", "basis_last_token_gram"]
    missing = [k for k in need if k not in f]
    if missing:
        raise InputError(f"has {', '.join(names)} but no {', '.join(missing)}; the file is incomplete", path)
    psi = n_features(d)
    A = formats.read_array(f, "basis", path).astype(np.float64)
    if A.shape != (d, d):
        raise InputError(f"'basis' has shape {A.shape}, expected ({d}, {d})", path)
    if not np.isfinite(A).all() or basis_mod.row_scaled_cond(A) > SINGULAR_BASIS_COND:
        raise InputError("'basis' is singular; the file is corrupted", path)
    assert stored is not None, "the file holds the Gram's datasets (none missing), so a storage claims them"
    gb = stored.from_file(f, path, psi // d, d)  # validated by its storage
    mb = None
    if has_targets:
        mb = formats.read_array(f, "basis_moments", path).astype(np.float64)
        if mb.shape != (psi, e):
            raise InputError(f"'basis_moments' has shape {mb.shape}, expected ({psi}, {e})", path)
    if version < CANONICAL_FORMAT:
        D = basis_mod.feature_scale(d)
        g = gb.expand()  # held dense: a file of this version has no other form
        g *= D[:, None]
        g *= D[None, :]
        mb = None if mb is None else mb * D[:, None]
        btg, blg = A.T @ tg @ A, A.T @ lg @ A
    else:
        btg = formats.read_array(f, "basis_token_gram", path).astype(np.float64)
        blg = formats.read_array(f, "basis_last_token_gram", path).astype(np.float64)
        for name, arr in (("basis_token_gram", btg), ("basis_last_token_gram", blg)):
            if arr.shape != (d, d) or not np.isfinite(arr).all():
                raise InputError(f"'{name}' has shape {arr.shape} or non-finite values, expected finite ({d}, {d})",
                                 path)
    return {"basis": A, "basis_gram": gb, "basis_moments": mb, "basis_token_gram": btg,
            "basis_last_token_gram": blg}


def _load_block(f: h5py.File, path: str | os.PathLike, d: int, has_targets: bool,
                stored: type[gram_storage.GramStorage] | None, e: int) -> dict[str, Any]:
    """The basis, the data's spans and the block sums of a file featurized on the spans (format >= 4;
    targets `e` wide)."""
    need = ["basis", "span_pairs", "span_last", "basis_token_gram", "basis_last_token_gram"]
    need += ["basis_moments"] if has_targets else []
    missing = [k for k in [*need, *(["basis_gram"] if stored is None else stored.file_datasets)] if k not in f]
    if missing:
        raise InputError(f"holds the block on the data's spans but no {', '.join(missing)}; the file is "
                         "incomplete", path)
    q = d * (d + 1) // 2
    out: dict[str, Any] = {k: formats.read_array(f, k, path).astype(np.float64) for k in need}
    out.setdefault("basis_moments", None)
    A: np.ndarray = out["basis"]
    E: np.ndarray = out["span_pairs"]
    F: np.ndarray = out["span_last"]
    if A.shape != (d, d) or not np.isfinite(A).all() or basis_mod.row_scaled_cond(A) > SINGULAR_BASIS_COND:
        raise InputError(f"'basis' has shape {A.shape} or is singular, expected an invertible ({d}, {d})", path)
    for name, M, rows in (("span_pairs", E, q), ("span_last", F, d)):
        if M.ndim != 2 or M.shape[0] != rows or M.shape[1] > rows or not np.isfinite(M).all() \
                or np.abs(M.T @ M - np.eye(M.shape[1])).max() > ORTHONORMAL_TOL:
            raise InputError(f"'{name}' must have orthonormal columns of length {rows}, got shape {M.shape}", path)
    n = E.shape[1] * F.shape[1]
    assert stored is not None, "the file holds the Gram's datasets (none missing), so a storage claims them"
    out["basis_gram"] = stored.from_file(f, path, E.shape[1], F.shape[1], block=True)  # validated by its storage
    mb = out["basis_moments"]
    if mb is not None and mb.shape != (n, e):
        raise InputError(f"'basis_moments' has shape {mb.shape}, expected ({n}, {e})", path)
    for name in ("basis_token_gram", "basis_last_token_gram"):
        if out[name].shape != (d, d) or not np.isfinite(out[name]).all():
            raise InputError(f"'{name}' has shape {out[name].shape} or non-finite values, expected finite ({d}, {d})",
                             path)
    return out


class _Derived:
    """`Features.gram` to be derived from the basis sums when first used (`Features.finalize`)."""

    def __repr__(self) -> str:
        return "<gram derived from the basis sums when used>"

    def __reduce__(self) -> str:
        return "DERIVED"  # unpickled as the module's one instance (`_get_gram` tests identity)


DERIVED = _Derived()


class StoredGram:
    """The 'gram' dataset of a features file: validated when the file was loaded (tile by tile),
    read when first used (certify and fit never need it)."""

    def __init__(self, path: str | os.PathLike, psi: int) -> None:
        self.path = str(path)
        self.abspath = os.path.abspath(path)
        self.psi = psi
        self.stamp = _stamp(self.abspath)

    def __repr__(self) -> str:
        return f"<gram stored in {self.path}>"

    def read(self) -> np.ndarray:
        if _stamp(self.abspath) != self.stamp:
            raise InputError("changed since its statistics were loaded (its 'gram' is read when first "
                             "used); run the command again", self.path)
        with formats.open_input(self.abspath) as f:
            gram = formats.read_matrix(f, "gram", self.path)
        if gram.shape != (self.psi, self.psi):
            raise InputError(f"'gram' has shape {gram.shape}, expected ({self.psi}, {self.psi})", self.path)
        return gram


def _stamp(path: str) -> tuple[int, ...] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)


def _stored_gram(f: h5py.File, path: str | os.PathLike, d: int, psi: int) -> StoredGram:
    """Validate the stored own gram without holding it (shape, finite, symmetric); read when used."""
    ds = formats.dataset(f, "gram", path)
    if ds.shape != (psi, psi):
        formats.read_array(f, "gram", path)  # its NaN / Inf are reported first, as they always were
        raise InputError(f"'gram' has shape {ds.shape}, expected (psi, psi) = ({psi}, {psi}) for d = {d}", path)
    formats.check_stored_symmetric(f, "gram", path)
    return StoredGram(path, psi)
