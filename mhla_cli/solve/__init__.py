"""Layer 5, solve: from statistics to a certificate and a fit.

domains (the full and observed certificate domains: map, dimensions, names, factorization), certificate
(`certify`, `Certificate`, its explanation), lstsq (the least-squares / ridge fit), probes (certificates on
probe sequences), witness (a counterexample pair of functions), ridge_cv (--ridge auto by K-fold CV),
lowrank (few-head and nuclear fits), spectrum (the head count from W's spectrum).
"""
