"""Certificate domains (mhla_cli.solve.domains): the lookup by name, each domain's map, dimensions,
feature names and factorization, and a new domain as one class."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from conftest import write_tokens
from mhla_cli import certify, featurize
from mhla_cli.errors import InputError
from mhla_cli.solve import domains
from mhla_cli.solve.domains import DOMAINS, FULL, OBSERVED, Domain, Full, check_domain, domain_map, get_domain


def _zero_coordinate_feats(tmp_path: Path):  # d = 3 tokens whose coordinate 1 is always 0
    rng = np.random.default_rng(5)
    X = rng.standard_normal((300, 6, 3))
    X[:, :, 1] = 0
    return featurize(write_tokens(tmp_path / "z.h5", X, None, rng.standard_normal((300, 3))))


def test_lookup_by_name() -> None:
    assert list(DOMAINS) == ["full", "observed"]
    assert get_domain("full") is FULL and get_domain("observed") is OBSERVED and get_domain(OBSERVED) is OBSERVED
    assert check_domain("observed") == "observed"
    with pytest.raises(InputError, match="unknown domain 'half', expected full or observed"):
        get_domain("half")


def test_each_domain_owns_its_map_dims_names_and_factorization(tmp_path: Path) -> None:
    feats = _zero_coordinate_feats(tmp_path)
    assert FULL.dims(feats) == (3, 3) and OBSERVED.dims(feats) == (2, 2)
    assert FULL.map_b(feats) is None
    T = OBSERVED.map_b(feats)
    assert T.shape == (6, 18) and np.allclose(T @ T.T, np.eye(6), atol=1e-12)  # orthonormal rows
    Tn, r, s = domain_map(feats, "observed")
    assert (r, s) == (2, 2) and Tn.shape == (6, 18)
    assert FULL.feature_names(feats, 3, 3)[:2] == ["S[0,0]*x_n[0]", "S[0,0]*x_n[1]"]
    assert OBSERVED.feature_names(feats, 2, 2) == [f"S'[{a},{b}]*x_n'[{c}]" for a, b in ((0, 0), (0, 1), (1, 1))
                                                    for c in range(2)]
    fac = OBSERVED.factorize(feats)
    assert fac is feats.factor_cache["observed"] and fac.n_full == 6
    assert domains.factorize(feats, "full") is feats.factor_cache["full"]
    reasons, zero = FULL.zero_coordinates(feats)
    assert any("coordinate(s) 1 are always 0" in r for r in reasons) and zero(1)  # S[0,1]*x_n[1]
    assert OBSERVED.zero_coordinates(feats) == ([], None)


def test_a_new_domain_is_one_class(tmp_path: Path) -> None:
    """A subclass with a name is registered for the lookup, and certify speaks about it."""

    class AllInputs(Full):
        name = "all-inputs-test"

    try:
        assert get_domain("all-inputs-test") is DOMAINS["all-inputs-test"]
        feats = _zero_coordinate_feats(tmp_path)
        cert = certify(feats, domain="all-inputs-test")
        full = certify(feats)
        assert cert.domain == "all-inputs-test" and not cert.identifiable
        assert (cert.lambda_max, cert.rank, cert.reasons) == (full.lambda_max, full.rank, full.reasons)
    finally:
        del DOMAINS["all-inputs-test"]
    assert isinstance(FULL, Domain) and repr(OBSERVED) == "Observed()"
