"""The old home of the certificate and the least-squares fit: every name is importable from here.

The code lives in mhla_cli.solve.domains (the certificate domains and the cached factorization),
mhla_cli.solve.certificate (`certify`, `Certificate`) and mhla_cli.solve.lstsq (`fit`, `train_mse`);
this module re-exports them (and EPS, numerical_tolerance from mhla_cli.numerics) so that
`from mhla_cli.solve.solve import certify, fit` keeps working.
"""

from __future__ import annotations

from ..numerics import EPS, numerical_tolerance
from .certificate import Certificate, certify
from .domains import (DEVICE_COPIES, DOMAINS, Domain, Full, Observed, check_domain, domain_map, factorize,
                      get_domain, observed_bases, range_basis)
from .lstsq import fit, train_mse

__all__ = ["Certificate", "DEVICE_COPIES", "DOMAINS", "Domain", "EPS", "Full", "Observed", "certify", "check_domain",
           "domain_map", "factorize", "fit", "get_domain", "numerical_tolerance", "observed_bases", "range_basis",
           "train_mse"]
