"""Certificates on given inputs: are the model's outputs on these probes determined by the data?

A model's output on an input Z is p . H(Z). Every zero-loss model (every least-squares solution)
gives the same output at Z exactly when H(Z) lies in the range of gram (the span of the training
features); a component in gram's null space is a direction along which two zero-loss models differ.
`certify_probes` streams a tokens file of probes (every sequence, or every weighted position of
per-position data), and measures for each the relative component of H(Z) in gram's numerical null
space, ||Z0^T h|| / ||h|| with Z0 an orthonormal basis of that null space (eigenvalues of Lambda_D =
gram / N at or below the certificate's threshold psi * eps * lambda_max). A probe is determined when
it is <= DETERMINED_TOL. Like the certificate, this is measured on the canonical features h of the
whitened probes Z A (mhla_cli.statistics.basis), so it does not depend on the units of the tokens.

It fails safe like the certificate: where the training tokens have directions float64 does not
resolve (the full certificate then says "not resolvable in float64"), the whitening keeps them at the
largest scale and a probe's component along them is measured at the data's unknown small scale, not
the unit-free one. Those directions are found where the whitening left them, in the canonical
coordinates (basis.unresolved_canonical), and a probe whose whitened tokens have a component along them
above its rounding (UNRESOLVED_PROBE_FACTOR, `unresolved_tokens`) is reported as not resolvable (and
not determined), whatever its residual: no cut in the tokens' own units decides.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from ..io import formats
from ..errors import InputError
from ..statistics import basis as basis_mod
from ..statistics.basis import pair_scale
from ..feature_map import n_features
from ..numerics import EPS, UNRESOLVED_PROBE_FACTOR, numerical_tolerance
from .domains import Domain, get_domain
from ..statistics.structure import Structure
from mhla_cli.statistics.features import Features
from mhla_cli.statistics.ranges import default_chunk_size
from ..io.tokens import TokensInfo, check_finite, check_weights, inspect_tokens, iter_chunks, read_as, with_bias_terms
from ..samples import Samples

# A probe is determined when the relative component of its feature vector in gram's numerical
# null space is at most DETERMINED_TOL (mhla_cli.numerics; the null space of the full-domain certificate).
from ..numerics import DETERMINED_TOL  # noqa: E402


@dataclass
class NullSpace:
    """gram's numerical null space: the exact nulls outside the data's spans (`structure`,
    mhla_cli.statistics.structure) and an orthonormal basis (n, k) of the null space of the block on them."""

    basis: np.ndarray
    lambda_max: float
    threshold: float
    token_basis: np.ndarray  # A: the null space is that of the canonical features of Z A
    structure: Structure | None = None  # None: `basis` is in the canonical features themselves
    # the domain's map of canonical pair rows s and tokens x, (P, C): its features (P s) (x) (C^T x);
    # None: the full domain (the canonical features themselves)
    row_maps: tuple[np.ndarray, np.ndarray] | None = None
    domain: str = "full"
    # (d, k) orthonormal: the token directions float64 does not resolve in the data, in the canonical
    # coordinates of token_basis (basis.unresolved_directions; k = 0: none)
    unresolved: np.ndarray | None = None

    @property
    def dim(self) -> int:
        outside = 0 if self.structure is None else self.structure.n_full - self.structure.n
        return outside + int(self.basis.shape[1])


def null_space(feats: Features, domain: str | Domain = "full") -> NullSpace:
    """Numerical null space of Lambda_D = gram / N: eigenvectors with eigenvalue <= psi eps lambda_max.

    The one place that decides which feature directions the data leave free; in the canonical basis
    (the features of the tokens Z A, A = feats.basis), as the certificate of `domain` (a name or a
    mhla_cli.solve.domains.Domain): its features, and its factorization (shared with certify and fit).
    """
    dom = get_domain(domain)
    A, _, _ = feats.solver_stats()
    fac = dom.factorize(feats)  # shared with certify and fit
    lmax = fac.lambda_max()
    tol = numerical_tolerance(lmax, fac.n_full)
    st = fac.structure
    if not fac.dense and fac.proves_above(tol):  # positive definite block: no eigenvectors
        basis = np.zeros((fac.n, 0))
    else:
        basis = np.ascontiguousarray(fac.null_space(tol)[1])
    # a property of the data's tokens, whatever the domain: the whitening could not scale them
    # counted in the canonical coordinates, where the whitening left them (basis.unresolved_canonical)
    Gb = feats.basis_token_gram
    assert Gb is not None  # factorized: the statistics are in their basis
    unresolved = basis_mod.unresolved_directions(Gb, basis_mod.unresolved_canonical(Gb))
    return NullSpace(basis=basis, lambda_max=lmax, threshold=tol, token_basis=A, structure=st,
                     row_maps=dom.row_maps(feats), domain=dom.name, unresolved=unresolved)


def unresolved_tokens(ns: NullSpace, tokens: np.ndarray, tokens_b: np.ndarray) -> np.ndarray | None:
    """Per token row: whether its whitened z A (`tokens_b`, of the rows `tokens` z) has a component along
    the data's unresolved directions U (canonical coordinates) above UNRESOLVED_PROBE_FACTOR times its
    rounding bound d eps (|| |z| |A U| || + ||z A||); None when the data leave no such direction.

    The component is z (A U): the canonical coordinates along U taken from z directly through the
    covectors A U, not as (z A) U, whose rounding d eps |z| |A| is that of the largest own-unit scale
    (a token of scale c along a resolved direction hides a component of c eps along U, 1e-10 at c = 1e6:
    a probe off the data's plane looked determined). The bound is the rounding of z itself along U
    (|z| |A U|: invariant to a diagonal change of units) and of U (||z A||: U is orthonormal to eps in the
    canonical coordinates), so the verdict is the canonical one at any scale of the units."""
    U = ns.unresolved
    if U is None or U.shape[1] == 0:
        return None
    d = tokens.shape[1]
    AU = ns.token_basis @ U  # (d, k): the covectors of the unresolved canonical directions, in own units
    comp = np.linalg.norm(tokens @ AU, axis=1)
    bound = d * EPS * (np.linalg.norm(np.abs(tokens) @ np.abs(AU), axis=1) + np.linalg.norm(tokens_b, axis=1))
    return comp > UNRESOLVED_PROBE_FACTOR * bound


def _per_sample(flags: np.ndarray, offsets: np.ndarray, samples: Samples) -> np.ndarray:
    """Token flags -> per sample: a sample is flagged when a flagged token is among those its S sums
    (the sequence, the prefix X[:t+1] or the whole window, as the layout says): the layout's own S of the
    flags as a 1-wide token is their count there."""
    q = samples.queries(flags.astype(np.float64)[:, None], offsets)
    return q.sample_upper()[:, 0] > 0


def probe_residuals(ns: NullSpace, upper: np.ndarray, last: np.ndarray) -> np.ndarray:
    """Relative null-space component ||Z0^T h|| / ||h|| of the rows h = upper (x) last (0 for h = 0).

    On a domain other than the full one (`ns.row_maps`), the part of h outside the domain's features
    (h - T^T T h, T the domain's map with orthonormal rows) is an exact null direction of Lambda_D (no
    training input has it), so it counts as undetermined.
    """
    R = upper.shape[0]
    d = last.shape[1]
    assert upper.shape[1] * d == n_features(d)
    off = np.zeros(R)
    if ns.row_maps is not None:
        upper, last, off = _domain_rows(ns.row_maps, upper, last)
    st = ns.structure if ns.structure is not None else Structure.identity(upper.shape[1], last.shape[1])
    if ns.dim == 0 and not off.any() or R == 0:
        return np.zeros(R)
    # in-block coordinates of h, and the squared norm of its part outside the block (the exact nulls)
    inside, outside, norm2 = st.split_rows(upper, last)
    comp = inside @ ns.basis
    num2 = off + outside + np.einsum("ij,ij->i", comp, comp)
    norm2 = norm2 + off
    return np.where(norm2 > 0, np.sqrt(num2 / np.where(norm2 > 0, norm2, 1.0)), 0.0)


def _domain_rows(maps: tuple[np.ndarray, np.ndarray], s: np.ndarray, x: np.ndarray
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(P s, C^T x) rows and ||h - T^T T h||^2 for h = s (x) x, T h = (P s) (x) (C^T x) (orthonormal rows
    P, C^T): s_perp (x) x + s_par (x) x_perp, two orthogonal terms, each norm from its components."""
    P, C = maps
    sp, xp = s @ P.T, x @ C
    s_perp, x_perp = s - sp @ P, x - xp @ C.T
    ns_perp, nx = np.einsum("ij,ij->i", s_perp, s_perp), np.einsum("ij,ij->i", x, x)
    ns_par, nx_perp = np.einsum("ij,ij->i", sp, sp), np.einsum("ij,ij->i", x_perp, x_perp)
    return sp, xp, ns_perp * nx + ns_par * nx_perp


@dataclass
class ProbeReport:
    """Per-probe residuals and the verdict of `certify --on`."""

    residual: np.ndarray
    sequence: np.ndarray
    position: np.ndarray | None
    null_dim: int
    threshold: float
    lambda_max: float
    normalize: str
    samples: Samples  # the probes' layout (mhla_cli.samples)
    tol: float = DETERMINED_TOL
    info: dict[str, Any] = field(default_factory=dict)
    # per probe: its tokens touch token directions float64 does not resolve in the data (module
    # docstring); None: the data leave none
    unresolved: np.ndarray | None = None
    unresolved_dim: int = 0  # how many such token directions the data have

    @property
    def unresolvable(self) -> np.ndarray:
        """Indices of the probes not resolvable in float64 (also in `undetermined`)."""
        return np.zeros(0, dtype=np.int64) if self.unresolved is None else np.flatnonzero(self.unresolved)

    @property
    def per_position(self) -> bool:
        return self.samples.per_position

    @property
    def undetermined(self) -> np.ndarray:
        """Indices of the probes not determined: residual > tol, or not resolvable in float64."""
        bad = ~(self.residual <= self.tol)
        if self.unresolved is not None:
            bad |= self.unresolved
        return np.flatnonzero(bad)

    @property
    def n_probes(self) -> int:
        return int(self.residual.size)

    @property
    def determined(self) -> bool:
        return self.undetermined.size == 0

    def to_dict(self) -> dict[str, Any]:
        und = self.undetermined
        return {"determined": self.determined, "n_probes": self.n_probes, "n_undetermined": int(und.size),
                "tol": self.tol, "max_residual": float(self.residual.max()) if self.residual.size else 0.0,
                "null_dim": self.null_dim, "threshold": self.threshold, "lambda_max": self.lambda_max,
                "normalize": self.normalize, "per_position": self.per_position, "attention": self.samples.attention,
                "first_undetermined": [int(i) for i in und[:10]],
                "n_unresolvable": int(self.unresolvable.size), "unresolved_token_directions": self.unresolved_dim,
                "first_unresolvable": [int(i) for i in self.unresolvable[:10]]}

    def save(self, path: str | os.PathLike, inputs: tuple[str | os.PathLike, ...] = ()) -> None:
        """Write the report (kind "probes") atomically."""
        attrs = {"n_probes": self.n_probes, "n_undetermined": int(self.undetermined.size),
                 "determined": int(self.determined), "tol": self.tol, "null_dim": self.null_dim,
                 "threshold": self.threshold, "normalize": self.normalize, **self.samples.attrs(),
                 "n_unresolvable": int(self.unresolvable.size), "unresolved_token_directions": self.unresolved_dim}
        formats.write_file(path, "probes", {"residual": self.residual, "undetermined": self.undetermined,
                                            "unresolvable": self.unresolvable, "sequence": self.sequence,
                                            "position": self.position}, attrs, inputs)


def certify_probes(feats: Features, probes: str | os.PathLike, chunk_size: int | None = None,
                   progress: Callable[[int], None] | None = None, domain: str | Domain = "full") -> ProbeReport:
    """Test every probe of the tokens file `probes` against the training statistics `feats`.

    Probes are the sequences (last token) of the file, or every position with weight > 0 of
    per-position data (targets (T, d) / weights per position; `probe_samples`); their features use
    the training normalisation (feats.normalize). Streamed in chunks; memory O(chunk + psi^2). `domain`: the
    certificate domain whose null space is used (`null_space`); every domain gives the same verdict
    in exact arithmetic (a probe outside the domain is undetermined along the directions it leaves).
    """
    info = probe_samples(inspect_tokens(probes), feats)
    if feats.bias_terms:  # the statistics of the tokens (x, 1): so are the probes' features
        info = with_bias_terms(info, pad_targets=False)
    samples = info.samples
    if info.d != feats.d:
        raise InputError(f"the probes have d = {info.d} but the training data have d = {feats.d}", probes)
    ns = null_space(feats, domain)
    size = chunk_size or default_chunk_size(info)
    res, seqs, poss, unres = [], [], [], []
    for a, b, tokens, offsets, _y, weights in iter_chunks(info, (0, info.n_samples), size, with_weights=True):
        check_finite(tokens, offsets, None, a, probes)
        check_weights(weights, offsets, a, info.per_position, probes)
        with np.errstate(over="ignore", invalid="ignore"):
            # the canonical features of Z A (mhla_cli.statistics.basis): transformed tokens, orthonormal coordinates
            raw = np.asarray(tokens, dtype=np.float64)
            tokens = raw @ ns.token_basis
            flags = unresolved_tokens(ns, raw, tokens)
            q = samples.queries(tokens, offsets, feats.normalize)
            upper, last = q.sample_upper() * pair_scale(feats.d), q.x
        flagged = None if flags is None else _per_sample(flags, offsets, samples)
        lengths = np.diff(offsets)
        if samples.per_position:
            seq = np.repeat(np.arange(a, b), lengths)
            pos = np.arange(int(offsets[-1])) - np.repeat(offsets[:-1], lengths)
        else:
            seq, pos = np.arange(a, b), None
        if weights is not None:
            keep = weights > 0
            upper, last, seq = upper[keep], last[keep], seq[keep]
            pos = None if pos is None else pos[keep]
            flagged = None if flagged is None else flagged[keep]
        r = probe_residuals(ns, upper, last)
        if not np.isfinite(r).all():
            raise InputError("the probe features overflow float64 (tokens too large); rescale the data", probes)
        res.append(r)
        seqs.append(seq)
        if flagged is not None:
            unres.append(flagged)
        if pos is not None:
            poss.append(pos)
        if progress is not None:
            progress(b - a)
    if not res or sum(x.size for x in res) == 0:
        raise InputError("has no probe: every weight is 0", probes)
    return ProbeReport(residual=np.concatenate(res), sequence=np.concatenate(seqs).astype(np.int64),
                       position=np.concatenate(poss).astype(np.int64) if samples.per_position else None,
                       null_dim=ns.dim, threshold=ns.threshold, lambda_max=ns.lambda_max,
                       normalize=feats.normalize, samples=samples,
                       unresolved=np.concatenate(unres) if unres else None,
                       unresolved_dim=int(ns.unresolved.shape[1]) if ns.unresolved is not None else 0)


def probe_samples(info: TokensInfo, feats: Features) -> TokensInfo:
    """The probes file `info` read in the layout its probes have (mhla_cli.samples): its own, except for
    statistics whose model predicts every position (`Samples.predicts_every_position`: bidirectional
    windows): a per-position probes file is read in their layout (its attribute must agree), and one
    without per-position data gives every position of each window (per-sequence weights cannot mask
    positions: refused)."""
    samples = feats.samples
    if not samples.predicts_every_position or info.samples == samples:
        return info
    if info.per_position:
        return read_as(info, samples)
    if info.has_weights:
        raise InputError(f"the statistics are of {samples.name} samples (every position of a window) but the "
                         "probes' weights are per sequence: store one weight per position to mask positions",
                         info.path)
    return replace(info, samples=samples, has_targets=False)
