"""mhla_cli.solve.solve, the old home of the certificate and the least-squares fit: its names are the new
modules' (mhla_cli.solve.domains, certificate, lstsq) and the public ones."""

from __future__ import annotations

import mhla_cli
from mhla_cli import numerics
from mhla_cli.solve import certificate, domains, lstsq, solve


def test_every_old_name_is_the_new_modules_object() -> None:
    assert solve.certify is certificate.certify is mhla_cli.certify
    assert solve.Certificate is certificate.Certificate is mhla_cli.Certificate
    assert solve.fit is lstsq.fit and solve.train_mse is lstsq.train_mse
    for name in ("DOMAINS", "Domain", "Full", "Observed", "check_domain", "domain_map", "factorize", "get_domain",
                 "observed_bases", "range_basis", "DEVICE_COPIES"):
        assert getattr(solve, name) is getattr(domains, name), name
    assert solve.EPS == numerics.EPS and solve.numerical_tolerance is numerics.numerical_tolerance
    assert set(solve.__all__) <= set(dir(solve))
