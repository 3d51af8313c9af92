"""`FeaturesFields`: the fields and methods of a `Features` record as its mixins see them.

mhla_cli.statistics.features.Features is a dataclass mixing in `FeaturesAlgebra`
(mhla_cli.statistics.algebra) and `FeaturesFile` (mhla_cli.statistics.files.features_file); features.py
imports both, so neither can import it back. Both subclass `FeaturesFields`, whose body declares, for the
type checker only (under `if TYPE_CHECKING:`), the record's fields (types as in features.py) and the
methods the mixins call. At run time the class is empty: it adds no field, attribute nor method to the
record (the dataclass reads only the annotations of its own body).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Self

if TYPE_CHECKING:
    import numpy as np

    from mhla_cli.samples import ReadSpec, Samples
    from mhla_cli.statistics.affine_sums import AffineSums
    from mhla_cli.statistics.storage.gram_storage import GramStorage


class FeaturesFields:
    """The host record's fields and methods, declared for the mixins of `Features` (nothing at run time)."""

    if TYPE_CHECKING:
        def __init__(self, **fields: Any) -> None: ...  # the dataclass's __init__, keyword arguments only

        d: int
        n_samples: int
        n_tokens: int
        token_gram: np.ndarray
        last_token_gram: np.ndarray
        moments: np.ndarray | None
        target_gram: np.ndarray | None
        token_dtype: str
        sample_range: tuple[int, int] | None
        source: dict[str, Any] | None
        extra_attrs: dict[str, Any]
        basis: np.ndarray | None
        basis_moments: np.ndarray | None
        basis_token_gram: np.ndarray | None
        basis_last_token_gram: np.ndarray | None
        read: ReadSpec
        n_sequences: int | None
        span_pairs: np.ndarray | None
        span_last: np.ndarray | None
        factor_cache: dict[str, Any]
        target_sum: np.ndarray | None
        weight_sum: float | None
        token_weight_sum: float | None
        affine: AffineSums | None
        SUMS: ClassVar[tuple[str, ...]]
        BASIS_SUMS: ClassVar[tuple[str, ...]]

        # gram and basis_gram are descriptors on Features: read, an array (or None); set, any form they hold
        @property
        def gram(self) -> np.ndarray | None: ...
        @gram.setter
        def gram(self, value: Any) -> None: ...
        @property
        def basis_gram(self) -> np.ndarray | None: ...
        @basis_gram.setter
        def basis_gram(self, value: Any) -> None: ...

        @property
        def n_features(self) -> int: ...
        @property
        def samples(self) -> Samples: ...
        @property
        def normalize(self) -> str: ...
        @property
        def bias_terms(self) -> bool: ...
        @property
        def has_targets(self) -> bool: ...
        @property
        def d_out(self) -> int: ...
        @property
        def on_spans(self) -> bool: ...
        @property
        def _gram_raw(self) -> Any: ...
        @property
        def gram_storage(self) -> GramStorage | None: ...
        @property
        def weight(self) -> float: ...
        @property
        def token_weight(self) -> float: ...

        def finalize(self) -> Self: ...
        def canonical(self) -> Self: ...
        def copy(self) -> Self: ...
        def with_sums(self, **fields: Any) -> Self: ...
        @classmethod
        def zeros(cls, d: int, has_targets: bool, token_dtype: str = "float64", d_out: int | None = None) -> Self: ...
