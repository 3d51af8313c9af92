"""mhla: learn single-layer multi-head linear attention exactly and certify identifiability.

Library API (each CLI command is a thin layer over these):

    feats = featurize("data.h5")            # Features: gram, moments, ... (streamed, float64)
    cert = certify(feats)                   # Certificate: identifiable, lambda_min, ... (any storage, scheduler=)
    model = fit(feats)                      # Model: coef p (d, psi) and min-norm W (heads=, nuclear=: low rank)
    heads = export_heads(model)             # Heads: V, Q (H, d, d) (fewest=True: the fewest heads)
    yhat = predict(heads, tokens)           # in-memory forward pass
    write_tokens("data.h5", sequences, targets=Y)  # a tokens file from arrays (convert_files: from files)
    red = reduce_tokens("wide.h5", "r8.h5", dim=8)   # Reduction: maps P, U of wide tokens / targets to d = 8
    est = MHLA().fit(sequences, targets)    # scikit-learn-style estimator (mhla_cli.api.estimator)
    stats = block_statistics("layer.h5", [P0, P1])  # a layer as a sum of blocks, block b on tokens X P_b
    layer = fit(stats)                      # HeadsSum (certify(stats): the joint certificate; docs/blocks.md)

The package, by layer (lowest first; a module imports only from its own layer or a lower one, and each
subpackage's docstring maps its modules):

- `errors`: the exceptions of the library;
- `numerics`: EPS and every named tolerance;
- `signals`: SIGINT / SIGTERM / SIGHUP as an exception, so that outputs are cleaned up;
- `feature_map`: the cubic map H(X), its indices and sizes;
- `kernels`: per-chunk moments S = X^T X, X^T Y, the prefix Grams of every position;
- `samples`: the sample layouts (each one's rows, queries, token weights, divisor);
- `bias_terms`: the terms a head's biases add (the tokens (x, 1));
- `_version`: the version, written once;
- `linalg`: the dense linear algebra, its backends and the tiled matrix;
- `io`: files in and out (HDF5 formats, tokens files, conversion);
- `statistics`: the sufficient statistics, their storages and files, featurize;
- `model`: the learned function and what evaluates it;
- `solve`: from statistics to a certificate and a fit;
- `api`: the entry points above the solvers (fit, export, the estimator, inspect);
- `cli`: the `mhla` command line.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ._version import __version__
from .errors import InputError, MhlaError

# The public names and the module that defines each, imported on first use (PEP 562): `import mhla_cli`
# (and so every `mhla` command, `--version` and `--help`) loads neither NumPy's friends SciPy and h5py
# nor torch until a name that needs them is used.
_EXPORTS = {
    "convert_files": "io.convert", "write_tokens": "io.convert",
    "cubic_features": "feature_map", "feature_index": "feature_map", "n_features": "feature_map",
    "forward_heads": "model.forward", "predict": "model.forward", "predict_file": "model.forward",
    "Heads": "model.heads", "W_from_heads": "model.heads", "W_from_p": "model.heads", "heads_from_W": "model.heads",
    "p_from_heads": "model.heads", "p_from_W": "model.heads",
    "certify": "api.learn", "export_heads": "api.learn", "fit": "api.learn",
    "Model": "model.model", "load_function": "model.model",
    "Certificate": "solve.certificate",
    "Reduction": "model.reduce", "load_reduction": "model.reduce", "reduce_tokens": "model.reduce",
    "Features": "statistics.features", "featurize": "statistics.stream", "load_features": "statistics.stream", "accumulate_range": "statistics.ranges",
    "Dataset": "model.synthetic", "generate_assoc": "model.synthetic", "generate_teacher": "model.synthetic",
    "MHLA": "api.estimator",
    "BlockStatistics": "solve.blocks", "block_statistics": "solve.blocks",
    "HeadsSum": "model.heads_sum", "load_blocks": "model.heads_sum", "sum_of_blocks": "model.heads_sum",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # the same names for type checkers and the layout test's re-export map
    from .io.convert import convert_files, write_tokens
    from .api.estimator import MHLA
    from .feature_map import cubic_features, feature_index, n_features
    from .model.forward import forward_heads, predict, predict_file
    from .model.heads import Heads, W_from_heads, W_from_p, heads_from_W, p_from_heads, p_from_W
    from .api.learn import certify, export_heads, fit
    from .model.model import Model, load_function
    from .model.reduce import Reduction, load_reduction, reduce_tokens
    from .solve.certificate import Certificate
    from .statistics.features import Features
    from .statistics.ranges import accumulate_range
    from .statistics.stream import featurize, load_features
    from .model.synthetic import Dataset, generate_assoc, generate_teacher
    from .solve.blocks import BlockStatistics, block_statistics
    from .model.heads_sum import HeadsSum, load_blocks, sum_of_blocks

__all__ = [
    "Certificate", "Dataset", "MHLA", "Features", "Heads", "InputError", "MhlaError", "Model", "Reduction", "W_from_heads",
    "W_from_p", "__version__", "certify", "convert_files", "cubic_features", "export_heads", "feature_index", "featurize",
    "fit", "forward_heads", "generate_assoc", "generate_teacher", "heads_from_W", "load_features", "load_function",
    "load_reduction", "n_features", "p_from_W", "p_from_heads", "predict", "predict_file", "accumulate_range", "reduce_tokens", "write_tokens",
    "BlockStatistics", "HeadsSum", "block_statistics", "load_blocks", "sum_of_blocks",
]
