"""mhla: learn single-layer multi-head linear attention exactly and certify identifiability.

Library API (each CLI command is a thin layer over these):

    feats = featurize("data.h5")            # Features: gram, moments, ... (streamed, float64)
    cert = certify(feats)                   # Certificate: identifiable, lambda_min, ...
    model = fit(feats)                      # Model: coef p (d, psi) and min-norm W (heads=, nuclear=: low rank)
    heads = export_heads(model)             # Heads: V, Q (H, d, d) (fewest=True: the fewest heads)
    yhat = predict(heads, tokens)           # in-memory forward pass
    write_tokens("data.h5", sequences, targets=Y)  # a tokens file from arrays (convert_files: from files)
    red = reduce_tokens("wide.h5", "r8.h5", dim=8)   # Reduction: maps P, U of wide tokens / targets to d = 8
    est = MHLA().fit(sequences, targets)    # scikit-learn-style estimator (mhla_cli.estimator)
"""

from __future__ import annotations

from ._version import __version__
from .convert import convert_files, write_tokens
from .errors import InputError, MhlaError
from .features import cubic_features, feature_index, n_features
from .forward import forward_heads, predict, predict_file
from .heads import Heads, W_from_heads, W_from_p, heads_from_W, p_from_heads, p_from_W
from .learn import export_heads, fit
from .model import Model, load_function
from .reduce import Reduction, load_reduction, reduce_tokens
from .solve import Certificate, certify
from .stream import Features, featurize, load_features, reduce_span
from .synthetic import Dataset, generate_assoc, generate_teacher
from .estimator import MHLA

__all__ = [
    "Certificate", "Dataset", "MHLA", "Features", "Heads", "InputError", "MhlaError", "Model", "Reduction", "W_from_heads",
    "W_from_p", "__version__", "certify", "convert_files", "cubic_features", "export_heads", "feature_index", "featurize",
    "fit", "forward_heads", "generate_assoc", "generate_teacher", "heads_from_W", "load_features", "load_function",
    "load_reduction", "n_features", "p_from_W", "p_from_heads", "predict", "predict_file", "reduce_span", "reduce_tokens", "write_tokens",
]
