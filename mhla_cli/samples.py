"""What one sample of a tokens file is: the sample layouts, one class each (`Samples`).

A sample is a pair (S, x): the Gram S of the tokens a query attends to and the query token x; its
features are upper(S) (x) x and the model's output there is p . H (docs/bidirectional.md). A tokens file's sequences X (n x d) give samples in one of three layouts:

- `LAST` ("last"): one sample per sequence, S = X^T X and x = x_n; targets (N, d), weights (N,).
- `CAUSAL` ("causal"): one sample per position t, S_t = X[:t]^T X[:t] and x = x_t (a decoder's
  prefixes); targets (T, d) or (N, n, d), weights per position.
- `BIDIRECTIONAL` ("bidirectional"): one sample per position t, S = X^T X of the WHOLE window and
  x = x_t (an encoder's positions); same shapes as CAUSAL.

Each layout owns what differs between them: its samples' (S, x) pairs (`queries`: the forward
pass evaluates p there), the rows its samples add to the Gram's sum (`rows`: the two factors of
K = U^T V, mhla_cli.linalg.symgram), the weight each token carries in the token Gram
(`token_weights`), the divisor of `--normalize length` (`lengths`), the Gram rows per sequence
(`rows_per_sequence`, for sizing) and the count of its samples. The files store the layout as
`per_position` and `attention` (`attrs`, `from_attrs`); the reader, the accumulator, the forward
pass, the files and the estimator ask the layout and pass it on.

A layout is a frozen dataclass: layouts compare and pickle by value, and its fields are its parameters (a
sliding window's width), recorded in the files beside its name (`attrs`, `from_attrs`). A new layout is one
subclass, here or anywhere, registered with `register` (a per-position layout's name is its `attention`: the
files' attribute and the `--attention` value, whose choices are the registered names); the built-in ones
have their references in tests (tests/_reference.py, tests/test_samples.py) and their rows in docs/formats.md.
A `ReadSpec` is how a tokens file is read: the layout, the normalisation of S and the bias terms, one value.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, TypeVar

import numpy as np

from .errors import InputError
from .feature_map import check_normalize, pair_index
from .kernels import position_numbers, prefix_moments, sequence_moments, window_products

__all__ = ["BIDIRECTIONAL", "CAUSAL", "LAST", "LAYOUTS", "Queries", "ReadSpec", "Rows", "Samples",
           "SpanSamples", "attentions", "check_attention", "fitted_layout", "from_attrs", "layout_class",
           "layout_info", "named", "register", "samples_of"]

# A layout's parameter p is the file attribute ATTRS_PREFIX + p (`Samples.attrs`).
ATTRS_PREFIX = "attention_"


@dataclass
class Queries:
    """The (S, x) pairs of a chunk's samples, for the forward pass: sample r reads the S entries
    `upper[group[r]]` (group None: upper[r]) and the query token x[r]."""

    upper: np.ndarray  # (G, d(d+1)/2): S[j, k], j <= k, of each distinct S (normalised as asked)
    x: np.ndarray  # (R, d) float64: the query token of every sample
    group: np.ndarray | None = None  # (R,) intp: the S of each sample; None: one S per sample

    def sample_upper(self) -> np.ndarray:
        """(R, d(d+1)/2): the S entries of every sample."""
        return self.upper if self.group is None else self.upper[self.group]


@dataclass
class Rows:
    """A chunk's rows of the Gram's sum sum_r (s_r s_r^T) (x) V_r and of the moments sum_r s_r (x) Z_r
    (the factors of K = U^T V: mhla_cli.linalg.symgram), samples of weight 0 left out.

    One sample per row (`x`): V = w x x^T and Z = w x y^T, the weights w (None: all 1) and the targets
    y per row. Several samples per row (`xx`): V = sum_t w_t x_t x_t^T and Z = sum_t w_t x_t y_t^T
    over the samples that read the row's S, with the sums of their targets beside.
    """

    upper: np.ndarray  # (R, d(d+1)/2): the unnormalised S entries of each row
    lengths: np.ndarray  # (R,): the divisor of normalize="length" (the tokens in S)
    n_samples: int  # samples with weight > 0
    x: np.ndarray | None = None  # (R, d): the query token (one sample per row)
    w: np.ndarray | None = None  # (R,): its weight
    y: np.ndarray | None = None  # (R, e): its target
    xx: np.ndarray | None = None  # (R, d, d): sum_t w_t x_t x_t^T (several samples per row)
    xy: np.ndarray | None = None  # (R, d, e): sum_t w_t x_t y_t^T
    yy: np.ndarray | None = None  # (e, e): sum w y y^T over every sample of the chunk
    y_sum: np.ndarray | None = None  # (e,): sum w y
    # the chunk's token Grams when the rows give them for free (None: the accumulation sums over the tokens):
    # (sum w S over the samples, sum w x x^T over their query tokens, sum x x^T over every token)
    token_grams: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    @property
    def n_rows(self) -> int:
        return int(self.upper.shape[0])


@dataclass(frozen=True)
class Samples:
    """A sample layout (module docstring): a frozen dataclass whose fields are its parameters; layouts compare,
    hash and pickle by value (and `named`, `from_attrs` and unpickling give one instance per value)."""

    name: ClassVar[str] = ""
    per_position: ClassVar[bool] = True  # targets and weights are stored per position
    # a Gram row is a whole window and its token factor a second moment (Rows.xx): the accumulation
    # accumulates the Gram as its distinct entries K = U^T V whatever d (a syrk needs rank-one rows)
    window_rows: ClassVar[bool] = False
    # `predict` of a model fitted on these samples writes and scores its outputs at every position
    # without being asked (CAUSAL: only with --causal)
    predicts_every_position: ClassVar[bool] = False
    words: ClassVar[str] = ""  # what the samples are, in a user's words
    scored_words: ClassVar[str] = ""  # what `predict` scores in this layout, in a user's words

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.__repr__ = Samples.__repr__  # type: ignore[method-assign]  # kept by @dataclass (it is in the class)

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"<samples {self.name}{' ' + params if params else ''}>"

    def __reduce__(self) -> tuple[Any, tuple[Any, dict[str, Any]]]:  # by value: the class and its parameters
        return _interned, (type(self), self.params())

    @property
    def attention(self) -> str | None:
        """The `attention` attribute of per-position files and the `--attention` value: the name (None: LAST)."""
        return self.name if self.per_position else None

    def params(self) -> dict[str, Any]:
        """The layout's parameters (its dataclass fields), by name."""
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    def spans(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(start, stop) (n,) int64 of a per-position layout: the query at position t of a window of n positions
        reads S of the positions start[t] <= s < stop[t] (the torch module: mhla_cli.model._heads_module)."""
        raise NotImplementedError(f"the {self.name} layout gives no spans (a per-position layout does)")

    # ------------------------------------------------------------------ counts and sizing
    def count(self, n_sequences: int, n_tokens: int) -> int:
        """The number of samples of a file of that many sequences and tokens (before weights)."""
        return int(n_tokens) if self.per_position else int(n_sequences)

    def rows_per_sequence(self, mean_len: float) -> float:
        """Rows of the Gram's sum per sequence (chunk sizing: each row is a pair factor s)."""
        return 1.0

    def unit(self, unit_sequences: str = "sequences") -> str:
        """The word for the samples counted."""
        return "positions" if self.per_position else unit_sequences

    # ------------------------------------------------------------------ the math
    def lengths(self, offsets: np.ndarray) -> np.ndarray:
        """The divisor of normalize="length" of every distinct S (the tokens it sums), float64."""
        return np.diff(np.asarray(offsets, dtype=np.int64)).astype(np.float64)

    def queries(self, X: np.ndarray, offsets: np.ndarray, normalize: str = "none") -> Queries:
        """The (S, x) pair of every sample of a chunk (tokens X (t, d), offsets from 0), S divided by
        `lengths` with normalize="length"."""
        raise NotImplementedError

    def token_weights(self, offsets: np.ndarray, weights: np.ndarray | None
                      ) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
        """(c, query_rows, query_weights) of a chunk: sum over samples of w S = sum over tokens of c x x^T
        (c None: every token 1), and the query tokens' rows (None: every token) with their weights (None:
        all 1), for sum over samples of w x x^T (the last-token Gram)."""
        raise NotImplementedError

    def rows(self, X: np.ndarray, offsets: np.ndarray, weights: np.ndarray | None,
             targets: np.ndarray | None) -> Rows:
        """The chunk's rows of the Gram's sum (`Rows`), unnormalised, samples of weight 0 left out: one
        row per sample (`queries`), with its weight and target."""
        q = self.queries(X, offsets)
        upper, x, lengths = q.sample_upper(), q.x, self.lengths(offsets)
        if q.group is not None:
            lengths = lengths[q.group]
        w = None if weights is None else np.asarray(weights, dtype=np.float64)
        if w is not None:
            keep = np.flatnonzero(w > 0)
            if keep.size < w.size:
                upper, x, lengths, w = upper[keep], x[keep], lengths[keep], w[keep]
                targets = None if targets is None else targets[keep]
        return Rows(upper=upper, lengths=lengths, n_samples=int(upper.shape[0]), x=x, w=w, y=targets)

    # ------------------------------------------------------------------ files
    def attrs(self) -> dict[str, Any]:
        """The attributes that record the layout in a features, model or predictions file."""
        out: dict[str, Any] = {"per_position": int(self.per_position)}
        if self.attention is not None:
            out["attention"] = self.attention
        out.update({ATTRS_PREFIX + k: v for k, v in self.params().items()})
        return out

    def fit_attrs(self) -> dict[str, Any]:
        """The attributes that record the layout a model or heads were fitted on (`attrs` less per_position;
        {} for LAST): read back by `fitted_layout`."""
        return {k: v for k, v in self.attrs().items() if k != "per_position"}


@dataclass(frozen=True)
class SpanSamples(Samples):
    """A per-position layout whose query at position t reads S of a contiguous span of its window (`spans`): the
    rest (its (S, x) pairs, token weights, divisors) follows here, S from each window's prefix sums of x x^T (the
    error of an entry is eps times the window's prefix sums, not its span's). A subclass gives `spans` (and may
    give faster kernels, as CAUSAL does)."""

    def rows_per_sequence(self, mean_len: float) -> float:
        return max(1.0, float(mean_len))

    def _bounds(self, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(start, stop) (T,): every sample's span as rows of the chunk."""
        offsets = np.asarray(offsets, dtype=np.int64)
        start, stop = np.empty(int(offsets[-1]), np.int64), np.empty(int(offsets[-1]), np.int64)
        for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist()):
            s, e = self.spans(b - a)
            if not (np.all(0 <= s) and np.all(s < e) and np.all(e <= b - a)):
                raise ValueError(f"the {self.name} layout's spans of {b - a} positions are not within them")
            start[a:b], stop[a:b] = a + s, a + e
        return start, stop

    def lengths(self, offsets: np.ndarray) -> np.ndarray:
        start, stop = self._bounds(offsets)
        return (stop - start).astype(np.float64)

    def queries(self, X: np.ndarray, offsets: np.ndarray, normalize: str = "none") -> Queries:
        X = np.asarray(X, dtype=np.float64)
        offsets = np.asarray(offsets, dtype=np.int64)
        start, stop = self._bounds(offsets)
        U = _upper(X[:, :, None] * X[:, None, :])
        upper = np.empty_like(U)
        for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist()):  # each window's prefix sums
            C = np.concatenate([np.zeros((1, U.shape[1])), np.cumsum(U[a:b], axis=0)])
            upper[a:b] = C[stop[a:b] - a] - C[start[a:b] - a]
        if normalize == "length":
            upper /= (stop - start).astype(np.float64)[:, None]
        return Queries(upper, X)

    def token_weights(self, offsets: np.ndarray, weights: np.ndarray | None
                      ) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
        # c_s = the weights of the samples whose span holds token s: a difference array over the spans
        start, stop = self._bounds(offsets)
        w = np.ones(start.size) if weights is None else np.asarray(weights, dtype=np.float64)
        D = np.zeros(start.size + 1)
        np.add.at(D, start, w)
        np.add.at(D, stop, -w)
        return np.cumsum(D)[:-1], None, weights


@dataclass(frozen=True)
class ReadSpec:
    """How a tokens file's samples are read, one value from the options to the accumulation: the per-position
    layout (a layout, or a registered name whose parameters the file's attributes give; None: as the file's
    attributes say, `from_attrs`), the normalisation of S (mhla_cli.feature_map.NORMALIZATIONS; None: as the data say, "none" for a
    tokens file) and the bias terms (mhla_cli.bias_terms)."""

    layout: Samples | str | None = None
    normalize: str | None = "none"
    bias_terms: bool = False

    def __post_init__(self) -> None:
        if self.normalize is not None:
            check_normalize(self.normalize)
        if not (isinstance(self.layout, Samples) and not self.layout.per_position):  # LAST: last-token data
            check_attention(self.layout)
        object.__setattr__(self, "bias_terms", bool(self.bias_terms))

    @property
    def attention(self) -> str | None:
        """The per-position layout's name, the `attention` asked (None: as the file says, or LAST)."""
        return self.layout.attention if isinstance(self.layout, Samples) else self.layout


@dataclass(frozen=True)
class _Last(Samples):
    """One sample per sequence: its Gram and its last token."""

    name = "last"
    per_position = False
    words = "last-token samples (one per sequence)"
    scored_words = "the last tokens"

    def queries(self, X: np.ndarray, offsets: np.ndarray, normalize: str = "none") -> Queries:
        upper, last = _windows(X, offsets, normalize)
        return Queries(upper, last)

    def token_weights(self, offsets: np.ndarray, weights: np.ndarray | None
                      ) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
        c = None if weights is None else np.repeat(weights, np.diff(offsets))
        return c, np.asarray(offsets[1:]) - 1, weights


@dataclass(frozen=True)
class _Causal(Samples):
    """One sample per position: the prefix X[:t] (a decoder's causal attention)."""

    name = "causal"
    words = "causal prefixes (one sample per position t, S of the tokens up to t)"
    scored_words = "every prefix of each window"

    def spans(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros(n, dtype=np.int64), np.arange(1, n + 1, dtype=np.int64)

    def rows_per_sequence(self, mean_len: float) -> float:
        return max(1.0, float(mean_len))

    def lengths(self, offsets: np.ndarray) -> np.ndarray:
        return position_numbers(offsets)

    def queries(self, X: np.ndarray, offsets: np.ndarray, normalize: str = "none") -> Queries:
        upper, x = prefix_moments(X, offsets, normalize)
        return Queries(upper, x)

    def token_weights(self, offsets: np.ndarray, weights: np.ndarray | None
                      ) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
        # c_s = the weights of the prefixes that contain token s: a suffix sum within its sequence
        w = np.ones(int(offsets[-1])) if weights is None else weights
        seq = np.repeat(np.arange(offsets.size - 1), np.diff(offsets))
        tail = np.cumsum(w[::-1])[::-1]
        ends = np.append(tail, 0.0)[offsets[1:]]
        return tail - ends[seq], None, weights


@dataclass(frozen=True)
class _Bidirectional(Samples):
    """One sample per position, every one reading the whole window's S (an encoder's attention)."""

    name = "bidirectional"
    window_rows = True
    predicts_every_position = True
    words = "every position of the whole window (bidirectional: one sample per position t, S of all the window's tokens)"
    scored_words = "every position of each window"

    def spans(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        return np.zeros(n, dtype=np.int64), np.full(n, n, dtype=np.int64)

    def queries(self, X: np.ndarray, offsets: np.ndarray, normalize: str = "none") -> Queries:
        upper, _ = _windows(X, offsets, normalize)
        lengths: np.ndarray = np.diff(np.asarray(offsets, dtype=np.int64))
        return Queries(upper, np.asarray(X, dtype=np.float64), np.repeat(np.arange(lengths.size), lengths))

    def token_weights(self, offsets: np.ndarray, weights: np.ndarray | None
                      ) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
        # every position's S is the window's: token s carries the weight sum of its window's positions
        lengths = np.diff(offsets)
        total = lengths.astype(np.float64) if weights is None else np.add.reduceat(weights, offsets[:-1])
        return np.repeat(total, lengths), None, weights

    def rows(self, X: np.ndarray, offsets: np.ndarray, weights: np.ndarray | None,
             targets: np.ndarray | None) -> Rows:
        """One row per window: s = upper(X^T X) and the second moments X^T W X, X^T W Y of its positions
        (docs/bidirectional.md: the Gram (s s^T) (x) (X^T W X), the moments s (x) (X^T W Y))."""
        X = np.asarray(X, dtype=np.float64)
        offsets = np.asarray(offsets, dtype=np.int64)
        S, _ = sequence_moments(X, offsets)
        lengths = self.lengths(offsets)
        if weights is None:
            Xw, xx, n = X, S, int(X.shape[0])  # X^T W X of unit weights is S itself
        else:
            w = np.asarray(weights, dtype=np.float64)
            Xw = X * w[:, None]
            xx, n = window_products(Xw, X, offsets), int((w > 0).sum())
        total = lengths if weights is None else np.add.reduceat(np.asarray(weights, dtype=np.float64), offsets[:-1])
        out = Rows(upper=_upper(S), lengths=lengths, n_samples=n, xx=xx,
                   token_grams=(np.einsum("i,ijk->jk", total, S), xx.sum(axis=0), S.sum(axis=0)))
        if targets is not None:
            Y = np.asarray(targets, dtype=np.float64)
            out.xy = window_products(Xw, Y, offsets)
            Yw = Y if weights is None else Y * np.asarray(weights, dtype=np.float64)[:, None]
            out.yy, out.y_sum = Yw.T @ Y, Yw.sum(axis=0)
        if weights is not None:  # windows whose every position weighs 0 add nothing
            keep = np.flatnonzero(total > 0)
            if keep.size < lengths.size:
                out.upper, out.lengths, out.xx = out.upper[keep], lengths[keep], xx[keep]
                out.xy = None if out.xy is None else out.xy[keep]
        return out


def _windows(X: np.ndarray, offsets: np.ndarray, normalize: str) -> tuple[np.ndarray, np.ndarray]:
    """(the S entries of every whole sequence (B, d(d+1)/2), divided by its length with normalize="length";
    its last tokens (B, d))."""
    S, last = sequence_moments(X, offsets)
    upper = _upper(S)
    if normalize == "length":
        upper /= np.diff(np.asarray(offsets, dtype=np.int64)).astype(np.float64)[:, None]
    return upper, last


def _upper(S: np.ndarray) -> np.ndarray:
    """(B, d(d+1)/2): the entries S[j, k], j <= k, of each (d, d) S in pair order (a contiguous take of the
    flattened rows, not the fancy index S[:, j, k], which gathers through two index arrays)."""
    B, d = S.shape[0], S.shape[1]
    j, k = pair_index(d)
    return np.take(S.reshape(B, d * d), j * d + k, axis=1)


_CLASSES: dict[str, type[Samples]] = {}  # the registry: a layout's name -> its class
_INTERNED: dict[Samples, Samples] = {}  # one instance per value
_S = TypeVar("_S", bound=type[Samples])


def register(cls: _S) -> _S:
    """Register a layout class under its `name` (a new name; the same class again is a no-op); returns it."""
    if not (isinstance(cls, type) and issubclass(cls, Samples) and dataclasses.is_dataclass(cls) and cls.name):
        raise TypeError(f"a layout is a dataclass subclass of Samples with a name, got {cls!r}")
    if _CLASSES.setdefault(cls.name, cls) is not cls:
        raise ValueError(f"a layout named {cls.name!r} is registered already")
    return cls


def _interned(cls: type[Samples], params: dict[str, Any]) -> Samples:
    """The one instance of the layout `cls(**params)`."""
    layout = cls(**params)
    return _INTERNED.setdefault(layout, layout)


def layout_class(name: str) -> type[Samples]:
    """The registered layout class of a name (`register`)."""
    try:
        return _CLASSES[name]
    except KeyError:
        raise InputError(f"unknown sample layout {name!r}, expected one of {', '.join(_CLASSES)}") from None


def attentions() -> tuple[str, ...]:
    """The registered per-position layouts' names: the values of `--attention` and the files' `attention`."""
    return tuple(c.name for c in _CLASSES.values() if c.per_position)


for _cls in (_Last, _Causal, _Bidirectional):
    register(_cls)
LAST: Samples = _interned(_Last, {})
CAUSAL: Samples = _interned(_Causal, {})
BIDIRECTIONAL: Samples = _interned(_Bidirectional, {})
# the built-in layouts by name (a registered class with parameters is made by `named(name, **params)`)
LAYOUTS: dict[str, Samples] = {s.name: s for s in (LAST, CAUSAL, BIDIRECTIONAL)}


def named(name: str, **params: Any) -> Samples:
    """The layout of a registered name (and its parameters, if it has any)."""
    cls = layout_class(name)
    try:
        return _interned(cls, params)
    except TypeError as e:
        raise InputError(f"the sample layout {name!r} takes the parameters "
                         f"{', '.join(f.name for f in dataclasses.fields(cls)) or 'none'}: {e}") from None


def check_attention(attention: str | Samples | None, what: str = "attention", path: Any = None) -> str | None:
    """A valid `attention` value (`attentions()`, or a per-position layout's) or None; `what` and `path` name it in
    the InputError."""
    if isinstance(attention, Samples):
        attention = attention.attention
        if attention is None:
            raise InputError(f"{what}: the {LAST.name} layout is not a per-position attention", path)
    if attention is not None and attention not in attentions():
        raise InputError(f"{what} is {attention!r}, expected {' or '.join(attentions())}", path)
    return attention


def samples_of(per_position: bool, attention: str | Samples | None = None) -> Samples:
    """The layout of data with per-position targets or not, read with `attention` (None: causal)."""
    if not per_position:
        if attention not in (None, CAUSAL.attention, CAUSAL, LAST):
            raise InputError(f"attention {getattr(attention, 'attention', attention)!r} applies to per-position "
                             "samples (targets at every position: per_position=True)")
        return LAST
    if isinstance(attention, Samples):
        check_attention(attention)
        return _INTERNED.setdefault(attention, attention)
    return named(check_attention(attention) or CAUSAL.name)


def from_attrs(attrs: Any, path: Any = None) -> Samples:
    """The layout recorded in a file's attributes (`Samples.attrs`): `per_position` (0/1), `attention` and the
    layout's parameters; files without `attention` are causal when per-position (the attribute is optional; causal is its default)."""
    per_position = bool(int(attrs.get("per_position", 0)))
    attention = _text(attrs.get("attention"))
    if attention is None:
        return samples_of(per_position)
    attention = check_attention(attention, "attribute 'attention'", path)
    if not per_position:
        raise InputError(f"attribute 'attention' is {attention!r} but 'per_position' is 0: attention applies "
                         "to per-position samples only; the file is inconsistent", path)
    cls = _CLASSES[str(attention)]
    params = {}
    for f in dataclasses.fields(cls):
        key = ATTRS_PREFIX + f.name
        if key not in attrs:
            raise InputError(f"the {attention} layout needs the attribute {key!r}; the file has none", path)
        v = attrs[key]
        params[f.name] = _text(v.item() if hasattr(v, "item") else v)
    try:
        return _interned(cls, params)
    except (TypeError, ValueError) as e:
        raise InputError(f"the attributes of the {attention} layout are invalid: {e}", path) from None


def layout_info(info: Any) -> dict[str, Any]:
    """The entries of a model's or heads' info (or a file's attributes) that record a fitted layout (`fit_attrs`)."""
    return {k: _text(v) for k, v in info.items() if k == "attention" or str(k).startswith(ATTRS_PREFIX)}


def fitted_layout(info: Any, path: Any = None) -> Samples:
    """The layout a model or heads were fitted on, as their info records it (`fit_attrs`; LAST without it)."""
    if info.get("attention") is None:
        return LAST
    return from_attrs({**layout_info(info), "per_position": 1}, path)


def _text(v: Any) -> Any:
    return v.decode() if isinstance(v, bytes) else v
