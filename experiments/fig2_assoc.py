"""Fig. 2 of the paper: associative memory, certificate vs distance to the true function.

Data (mhla_cli.model.synthetic.generate_assoc): 4 key/value pairs of dimension 4 (token dimension d = 8),
2^14 sequences of 5 tokens: rows (k_j, v_j), then the query (q, 0); target (0, sum_j <q,k_j> v_j), which
is exactly the 1-head teacher V = [[0,0],[0,I]], Q = [[I,0],[0,0]]. A share f of the samples take keys
and values from rows of random orthogonal matrices, the rest are Gaussian N(0, I/4).

(a) f swept over 95..100 %: observed-domain lambda_min (the paper's metric: Lambda_D of the features in
    the tokens' own coordinates, reduced to the observed domain; the full-domain lambda_min is 0 for
    all such data because the query's value part is always 0), mhla's verdict (certify(domain=
    'observed'), whose lambda_min is the canonical one: whitened tokens, orthonormal features), the distance
    ||p - p_true||_F of mhla's minimum-norm fit, of AdamW-trained MHLA (1, 2, 4, 8 heads, random init),
    and of a certify witness (another zero-loss solution) when the certificate fails.
(b) full-rank (all Gaussian, f = 0) vs rank-deficient (f = 1) data: the same distances, two init scales.

Data are kept float64 in memory (the Dataset object): `mhla generate assoc` stores float32 by default,
and float32 rounding of tokens and targets makes the data slightly unrealisable; the column
"fit, float32 file" shows what that does.

    python experiments/fig2_assoc.py            # full run, ~5 min on 2 cores (17 min under heavy load)
    python experiments/fig2_assoc.py --quick    # tiny version, < 1 min

Equivalent CLI for one point (f = 99 %):
    mhla generate assoc -o a99.h5 --keys 4 --n-samples 16384 --orthogonal-fraction 0.99 --dtype float64 --teacher-out true.h5
    mhla certify a99.h5 --domain observed --json
    mhla fit a99.h5 -o fit99.h5 && mhla compare fit99.h5 true.h5 --json
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np

from _common import add_doc_image_flag, doc_images, Timer, env_note, features_of, fmt, limit_threads, markdown_table, savefig, write_json
from mhla_cli.model import synthetic
from mhla_cli import certify, fit, predict
from mhla_cli.statistics.basis import pair_map
from mhla_cli.solve.domains import domain_map, observed_bases
from mhla_cli.statistics.features import Features

KEYS = 4
FRACTIONS = (0.95, 0.96, 0.97, 0.98, 0.99, 1.0)
HEADS = (1, 2, 4, 8)


def observed_feature_basis(B: np.ndarray, C: np.ndarray) -> np.ndarray:
    """Orthonormal basis (psi, r') of span{H(X) : tokens of X in U = range(B), last token in U_n = range(C)}.

    For such X, S = X^T X = B S' B^T with S' any symmetric r x r matrix (r = dim U) and x_n = C c, so
    H(X) = u(S) (x) x_n ranges over span{u(B E B^T) : E symmetric} (x) range(C), with u(S) the distinct
    entries S[j,k], j <= k (the feature order of docs/formats.md: (j,k) major, l fastest). Computed here
    from that definition, independently of the library's map T.
    """
    d, r = B.shape
    iu = np.triu_indices(d)
    cols = []
    for a in range(r):
        for b in range(a, r):
            E = np.outer(B[:, a], B[:, b])
            cols.append((E + E.T)[iu])
    Ls = np.array(cols).T                                   # (d(d+1)/2, r(r+1)/2)
    Us, sv, _ = np.linalg.svd(Ls, full_matrices=False)
    Qs = Us[:, : int((sv > 1e-12 * sv[0]).sum())]
    return np.kron(Qs, C)                                   # orthonormal: kron of orthonormal bases


def observed_projector(feats: Features) -> np.ndarray:
    """Orthogonal projector (psi, psi) onto the features that inputs of the observed domain excite.

    The observed domain is that of `certify --domain observed` (mhla_cli.solve.domains.observed_bases): tokens
    in U = span of all tokens, last tokens in U_n = span of all last tokens. Two functions agree on
    every such input iff (p1 - p2) @ P = 0; the observed distance is ||(p1 - p2) @ P||_F. (Not the row
    space of the map T to the reduced features: the two differ when U is a proper subspace of R^d.)
    For the associative memory (tokens span R^d, last tokens span the key coordinates) it selects the
    features S[j,k] * x_n[l] with l a key coordinate.
    """
    B, C = observed_bases(feats)
    d = feats.d
    if B.shape[1] == d and C.shape[1] == d:
        return np.eye(feats.n_features)
    Qb = observed_feature_basis(B, C)
    return Qb @ Qb.T


def distances(coef: np.ndarray, p_true: np.ndarray, P_obs: np.ndarray) -> tuple[float, float]:
    """||coef - p_true||_F on all features (the paper's metric) and on the observed-domain features."""
    D = coef - p_true
    return float(np.linalg.norm(D)), float(np.linalg.norm(D @ P_obs))


def witness(feats: Features, coef: np.ndarray, size: float, cert: Any = None) -> dict[str, Any] | None:
    """Another zero-loss solution when the observed-domain certificate fails.

    coef + size * e_a u^T, with u = z^T T a unit null direction z of the observed-domain Lambda'
    mapped back to the full features (so u^T H_i = 0 on every training sample), put on output
    coordinate a = the first value coordinate. None when the certificate passes.
    """
    cert = cert if cert is not None else certify(feats, domain="observed")
    if cert.identifiable or cert.null_vectors is None:
        return None
    T, _, _ = domain_map(feats, "observed")
    z = cert.null_vectors[:, 0]
    u = z if T is None else z @ T
    u = u / np.linalg.norm(u)
    alt = coef.copy()
    alt[KEYS] += size * u
    # Loss change on the data from the statistics: Delta gram Delta^T / N (relative to lambda_max).
    delta = alt - coef
    lift = float(np.einsum("ij,jk,ik->", delta, feats.lambda_d, delta))
    return {"coef": alt, "null_dim": int(cert.null_vectors.shape[1]), "loss_change": lift}


def mse_on(coef: np.ndarray, ds: synthetic.Dataset) -> float:
    pred = predict(coef, ds.tokens, ds.offsets)
    return float(np.mean((pred - ds.targets) ** 2))


def float32_copy(ds: synthetic.Dataset) -> synthetic.Dataset:
    """The dataset as `mhla generate assoc` stores it by default (tokens and targets rounded to float32)."""
    return synthetic.Dataset(ds.tokens.astype(np.float32).astype(np.float64), ds.offsets,
                             ds.targets.astype(np.float32).astype(np.float64))


def paper_lambda(feats: Features) -> np.ndarray:
    """Eigenvalues of Lambda_D = gram / N restricted to the observed domain, on the tokens' own
    upper-triangle features (the paper's lambda_min; mhla's certificate reports the canonical one)."""
    B, C = observed_bases(feats)
    T = np.kron(pair_map(B), C.T)
    return np.linalg.eigvalsh(T @ feats.lambda_d @ T.T)


def convex_point(f: float, n_samples: int, seed: int) -> dict[str, Any]:
    """Certificate, minimum-norm fit and witness for one orthogonal share f (no torch)."""
    ds, teacher = synthetic.generate_assoc(KEYS, n_samples, f, seed=seed)
    p_true = teacher.coef
    with Timer() as t:
        feats = features_of(ds)
        cert_obs = certify(feats, domain="observed")
        cert_full = certify(feats, domain="full")
        # the paper's lambda_min: Lambda_D on the tokens' own (upper-triangle) features, observed domain
        own_lam = paper_lambda(feats)
        model = fit(feats)
    P_obs = observed_projector(feats)
    dist, dist_obs = distances(model.coef, p_true, P_obs)
    model32 = fit(features_of(float32_copy(ds)))
    dist32, _ = distances(model32.coef, p_true, P_obs)
    out = {"f": f, "seed": seed, "n_samples": n_samples, "lambda_min_observed": float(own_lam[0]),
           "lambda_max_observed": float(own_lam[-1]), "identifiable_observed": cert_obs.identifiable,
           "lambda_min_observed_canonical": cert_obs.lambda_min, "lambda_max_observed_canonical": cert_obs.lambda_max,
           "rank_observed": cert_obs.rank, "n_features_observed": cert_obs.n_features,
           "lambda_min_full": cert_full.lambda_min, "identifiable_full": cert_full.identifiable,
           "fit_distance": dist, "fit_distance_observed": dist_obs, "fit_distance_float32": dist32,
           "fit_train_mse": mse_on(model.coef, ds), "seconds": t.seconds, "p_true_norm": float(np.linalg.norm(p_true))}
    try:  # `mhla certify --witness` (full domain): min-norm fit + a null direction of Lambda_D
        from mhla_cli.solve.witness import make_witness

        lw = make_witness(feats, cert=cert_full)
        ld, ld_obs = distances(lw.model_b.coef, p_true, P_obs)
        out["library_witness"] = {"distance": ld, "distance_observed": ld_obs,
                                  "train_mse": mse_on(lw.model_b.coef, ds), "verified": lw.info["verified"],
                                  "coef": lw.model_b.coef}
    except ImportError:  # pragma: no cover - older mhla without the witness module
        pass
    w = witness(feats, model.coef, size=float(np.linalg.norm(p_true)), cert=cert_obs)
    if w is not None:
        wd, wd_obs = distances(w["coef"], p_true, P_obs)
        out["witness"] = {"distance": wd, "distance_observed": wd_obs, "train_mse": mse_on(w["coef"], ds),
                          "null_dim": w["null_dim"], "loss_change": w["loss_change"], "coef": w["coef"]}
    out["_ds"], out["_p_true"], out["_P_obs"], out["_fit"] = ds, p_true, P_obs, model.coef
    return out


def adamw_point(ds: synthetic.Dataset, p_true: np.ndarray, P_obs: np.ndarray, heads: int, epochs: int,
                seed: int, test: synthetic.Dataset, batch_size: int = 128, lr: float = 1e-2,
                init_rms: float = 0.1) -> dict[str, Any]:
    """AdamW-trained MHLA from random init: training MSE, distances to the truth, MSE on Gaussian keys."""
    from mhla_torch import train_mhla

    r = train_mhla(ds.tokens, ds.targets, heads, epochs, batch_size=batch_size, lr=lr, seed=seed,
                   offsets=ds.offsets, schedule="cosine", init_rms=init_rms)
    dist, dist_obs = distances(r["coef"], p_true, P_obs)
    return {"heads": heads, "seed": seed, "init_rms": init_rms, "train_mse": r["history"][-1], "distance": dist,
            "distance_observed": dist_obs, "test_mse_gaussian": mse_on(r["coef"], test), "seconds": r["seconds"],
            "epochs": epochs}


def run(n_samples: int, fractions: tuple[float, ...], heads: tuple[int, ...], epochs: int, seeds_b: int,
        init_scales: tuple[float, ...]) -> dict[str, Any]:
    test, _ = synthetic.generate_assoc(KEYS, 4096, 0.0, seed=12345)  # Gaussian keys: off the orthogonal data
    res: dict[str, Any] = {"n_samples": n_samples, "epochs": epochs, "a": [], "b": []}
    for f in fractions:
        pt = convex_point(f, n_samples, seed=0)
        ds, p_true, P_obs = pt.pop("_ds"), pt.pop("_p_true"), pt.pop("_P_obs")
        fitc = pt.pop("_fit")
        pt["fit_test_mse_gaussian"] = mse_on(fitc, test)
        for key in ("witness", "library_witness"):
            if key in pt:
                pt[key]["test_mse_gaussian"] = mse_on(pt[key].pop("coef"), test)
        pt["adamw"] = [adamw_point(ds, p_true, P_obs, h, epochs, 0, test) for h in heads]
        res["a"].append(pt)
    for label, f in (("full rank (all Gaussian)", 0.0), ("rank-deficient (all orthogonal)", 1.0)):
        for seed in range(seeds_b):
            pt = convex_point(f, n_samples, seed=100 + seed)
            ds, p_true, P_obs = pt.pop("_ds"), pt.pop("_p_true"), pt.pop("_P_obs")
            pt["fit_test_mse_gaussian"] = mse_on(pt.pop("_fit"), test)
            for key in ("witness", "library_witness"):
                if key in pt:
                    pt[key]["test_mse_gaussian"] = mse_on(pt[key].pop("coef"), test)
            pt["label"] = label
            pt["adamw"] = [adamw_point(ds, p_true, P_obs, h, epochs, seed, test, init_rms=s)
                           for s in init_scales for h in heads]
            res["b"].append(pt)
    return res


def table_a(res: dict[str, Any]) -> str:
    header = ["orthogonal share", "lambda_min observed (log2)", "certified (observed)",
              "min-norm fit: dist (float64 data)", "fit: dist (float32 file)",
              "certify --witness (full domain): dist / train MSE / MSE on Gaussian keys",
              "observed-domain witness: dist / train MSE / MSE on Gaussian keys"]
    header += [f"AdamW {h}h: dist all / observed" for h in [a["heads"] for a in res["a"][0]["adamw"]]]
    rows = []
    for pt in res["a"]:
        lam = pt["lambda_min_observed"]
        lam_s = f"{fmt(lam)} ({np.log2(lam):.1f})" if lam > 0 else f"{fmt(lam)} (= 0)"
        w = pt.get("witness")
        ws = (f"{fmt(w['distance'])} / {fmt(w['train_mse'])} / {fmt(w['test_mse_gaussian'])}" if w else
              "none (certified)")
        lw = pt.get("library_witness")
        lws = f"{fmt(lw['distance'])} / {fmt(lw['train_mse'])} / {fmt(lw['test_mse_gaussian'])}" if lw else "—"
        row = [f"{100 * pt['f']:g} %", lam_s, "yes" if pt["identifiable_observed"] else
               f"no (rank {pt['rank_observed']}/{pt['n_features_observed']})",
               fmt(pt["fit_distance"]), fmt(pt["fit_distance_float32"]), lws, ws]
        row += [f"{fmt(a['distance'])} / {fmt(a['distance_observed'])}" for a in pt["adamw"]]
        rows.append(row)
    return markdown_table(header, rows)


def table_b(res: dict[str, Any]) -> str:
    header = ["data", "lambda_min observed", "model", "init RMS", "dist all features (median)",
              "dist observed domain (median)", "train MSE (median)", "MSE on Gaussian keys (median)", "paper (dist)"]
    rows = []
    for label in dict.fromkeys(pt["label"] for pt in res["b"]):
        pts = [pt for pt in res["b"] if pt["label"] == label]
        lam = float(np.median([pt["lambda_min_observed"] for pt in pts]))
        paper = "1e-7 .. 1e-4" if "full" in label else "~1"
        rows.append([label, fmt(lam), "mhla min-norm fit", "—", fmt(float(np.median([p["fit_distance"] for p in pts]))),
                     fmt(float(np.median([p["fit_distance_observed"] for p in pts]))),
                     fmt(float(np.median([p["fit_train_mse"] for p in pts]))),
                     fmt(float(np.median([p["fit_test_mse_gaussian"] for p in pts]))), paper])
        for key, name in (("library_witness", "certify --witness (full-domain null direction)"),
                          ("witness", "observed-domain witness (null direction of Lambda')")):
            ws = [p[key] for p in pts if key in p]
            if ws:
                rows.append(["", "", name, "—", fmt(float(np.median([w["distance"] for w in ws]))),
                             fmt(float(np.median([w["distance_observed"] for w in ws]))),
                             fmt(float(np.median([w["train_mse"] for w in ws]))),
                             fmt(float(np.median([w["test_mse_gaussian"] for w in ws]))), ""])
        keys = dict.fromkeys((a["init_rms"], a["heads"]) for p in pts for a in p["adamw"])
        for s, h in keys:
            runs = [a for p in pts for a in p["adamw"] if a["init_rms"] == s and a["heads"] == h]
            rows.append(["", "", f"AdamW MHLA {h} head(s)", fmt(s),
                         fmt(float(np.median([a["distance"] for a in runs]))),
                         fmt(float(np.median([a["distance_observed"] for a in runs]))),
                         fmt(float(np.median([a["train_mse"] for a in runs]))),
                         fmt(float(np.median([a["test_mse_gaussian"] for a in runs]))), paper])
    return markdown_table(header, rows)


def plot(res: dict[str, Any], name: str) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 4.8))
    floor = 2.0**-16
    lam = np.array([max(pt["lambda_min_observed"], floor) for pt in res["a"]])
    x = np.log2(lam)
    ax1.semilogy(x, [pt["fit_distance"] for pt in res["a"]], "ko-", label="mhla min-norm fit")
    ax1.semilogy(x, [pt["fit_distance_float32"] for pt in res["a"]], "k^:", label="mhla fit, float32-stored data")
    for i, h in enumerate(a["heads"] for a in res["a"][0]["adamw"]):
        ax1.semilogy(x, [pt["adamw"][i]["distance_observed"] for pt in res["a"]], "s-", color=f"C{i}",
                     label=f"AdamW {h}h (observed features)")
        ax1.semilogy(x, [pt["adamw"][i]["distance"] for pt in res["a"]], "s--", color=f"C{i}", alpha=0.5,
                     label=f"AdamW {h}h (all features)")
    lx = [xx for xx, pt in zip(x, res["a"]) if "library_witness" in pt]
    if lx:
        ax1.semilogy(lx, [pt["library_witness"]["distance"] for pt in res["a"] if "library_witness" in pt], "mx",
                     ms=9, label="certify --witness (full domain, zero loss)")
    wx = [xx for xx, pt in zip(x, res["a"]) if "witness" in pt]
    if wx:
        ax1.semilogy(wx, [pt["witness"]["distance"] for pt in res["a"] if "witness" in pt], "r*", ms=12,
                     label="observed-domain witness (zero loss)")
    for xx, pt in zip(x, res["a"]):
        ax1.annotate(f"{100 * pt['f']:g}%", (xx, 3e-16), fontsize=7, ha="center")
    ax1.set_xlabel(f"log2 lambda_min (observed domain); 0 plotted at log2 = {np.log2(floor):.0f}")
    ax1.set_ylabel("||p - p_true||_F")
    ax1.set_title("Fig. 2a: associative memory, 95-100 % orthogonal keys")
    ax1.legend(fontsize=6)
    labels = list(dict.fromkeys(pt["label"] for pt in res["b"]))
    heads = list(dict.fromkeys(a["heads"] for a in res["b"][0]["adamw"]))
    scales = sorted({a["init_rms"] for a in res["b"][0]["adamw"]})
    cols = [("fit", None)] + [(h, s) for s in scales for h in heads]
    width = 0.8 / len(labels)
    for li, label in enumerate(labels):
        pts = [pt for pt in res["b"] if pt["label"] == label]
        obs, full = [], []
        for h, s in cols:
            if h == "fit":
                obs.append(np.median([p["fit_distance_observed"] for p in pts]))
                full.append(np.median([p["fit_distance"] for p in pts]))
            else:
                runs = [a for p in pts for a in p["adamw"] if a["heads"] == h and a["init_rms"] == s]
                obs.append(np.median([a["distance_observed"] for a in runs]))
                full.append(np.median([a["distance"] for a in runs]))
        xs = np.arange(len(cols)) + (li - (len(labels) - 1) / 2) * width
        ax2.bar(xs, np.maximum(obs, 1e-17), width, color=f"C{li}", label=f"{label}: observed-domain features")
        ax2.plot(xs, np.maximum(full, 1e-17), "kx", ms=6, label="all features (incl. never-excited)" if li == 0 else None)
    ax2.set_xticks(range(len(cols)), ["mhla fit"] + [f"AdamW {h}h\ninit {s:g}" for h, s in cols[1:]], fontsize=6, rotation=30)
    ax2.set_yscale("log")
    ax2.set_ylabel("||p - p_true||_F")
    ax2.set_title("Fig. 2b: full-rank vs rank-deficient data")
    ax2.legend(fontsize=7)
    path = savefig(fig, name)
    plt.close(fig)
    return str(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="tiny version (< 1 min)")
    ap.add_argument("--epochs", type=int, default=None, help="AdamW epochs (default 50; quick 5)")
    ap.add_argument("--json", default=None, help="also write the raw results to this JSON file")
    ap.add_argument("--from-json", default=None, help="only print the tables and plot from a saved JSON file")
    add_doc_image_flag(ap)
    args = ap.parse_args(argv)
    doc_images(args.doc_image)
    limit_threads(1)
    if args.from_json:
        with open(args.from_json) as fh:
            res = json.load(fh)
        print(table_a(res))
        print()
        print(table_b(res))
        print(f"\nplot: {plot(res, 'fig2_assoc.png')}")
        return 0
    if args.quick:
        n, fr, hs, ep, sb, sc = 2048, (0.95, 1.0), (1, 8), args.epochs or 5, 1, (0.1,)
    else:
        n, fr, hs, ep, sb, sc = 2**14, FRACTIONS, HEADS, args.epochs or 50, 2, (0.1, 1.0)
    with Timer() as total:
        res = run(n, fr, hs, ep, sb, sc)
    print(f"## Fig. 2a: associative memory (4 pairs of dim 4, N = {n}, float64 in memory); AdamW {ep} epochs, "
          f"batch 128, lr 1e-2 cosine, init RMS 0.1{', QUICK' if args.quick else ''}\n")
    print(table_a(res))
    print(f"\n## Fig. 2b: full-rank vs rank-deficient ({sb} seed(s))\n")
    print(table_b(res))
    print(f"\nplot: {plot(res, 'fig2_assoc_quick.png' if args.quick else 'fig2_assoc.png')}")
    print(f"total {total.seconds:.0f} s; {env_note()}")
    if args.json:
        write_json(args.json, res)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
