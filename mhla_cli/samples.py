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

A new layout is one subclass here with its instance in `LAYOUTS` (a per-position layout's `attention`, the
files' attribute and the `--attention` value, is its name: add it to the option's choices in
mhla_cli/cli/options.py), its reference in tests (tests/_reference.py, tests/test_samples.py) and its row in
docs/formats.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from .errors import InputError
from .feature_map import pair_index
from .kernels import position_numbers, prefix_moments, sequence_moments, window_products

__all__ = ["ATTENTIONS", "BIDIRECTIONAL", "CAUSAL", "LAST", "LAYOUTS", "Queries", "Rows", "Samples",
           "check_attention", "from_attrs", "named", "samples_of"]



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


class Samples:
    """A sample layout (module docstring). Instances are the singletons of `LAYOUTS`: compare with `is`."""

    name: ClassVar[str] = ""
    attention: ClassVar[str | None] = None  # the `attention` attribute of per-position files
    per_position: ClassVar[bool] = True  # targets and weights are stored per position
    # a Gram row is a whole window and its token factor a second moment (Rows.xx): the accumulation
    # accumulates the Gram as its distinct entries K = U^T V whatever d (a syrk needs rank-one rows)
    window_rows: ClassVar[bool] = False
    # `predict` of a model fitted on these samples writes and scores its outputs at every position
    # without being asked (CAUSAL: only with --causal)
    predicts_every_position: ClassVar[bool] = False
    words: ClassVar[str] = ""  # what the samples are, in a user's words

    def __repr__(self) -> str:
        return f"<samples {self.name}>"

    def __reduce__(self) -> tuple[Any, tuple[str]]:  # the same singleton in another process
        return named, (self.name,)

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
        return out


class _Last(Samples):
    """One sample per sequence: its Gram and its last token."""

    name = "last"
    per_position = False
    words = "last-token samples (one per sequence)"

    def queries(self, X: np.ndarray, offsets: np.ndarray, normalize: str = "none") -> Queries:
        upper, last = _windows(X, offsets, normalize)
        return Queries(upper, last)

    def token_weights(self, offsets: np.ndarray, weights: np.ndarray | None
                      ) -> tuple[np.ndarray | None, np.ndarray | None, np.ndarray | None]:
        c = None if weights is None else np.repeat(weights, np.diff(offsets))
        return c, np.asarray(offsets[1:]) - 1, weights


class _Causal(Samples):
    """One sample per position: the prefix X[:t] (a decoder's causal attention)."""

    name = "causal"
    attention = "causal"
    words = "causal prefixes (one sample per position t, S of the tokens up to t)"

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


class _Bidirectional(Samples):
    """One sample per position, every one reading the whole window's S (an encoder's attention)."""

    name = "bidirectional"
    attention = "bidirectional"
    window_rows = True
    predicts_every_position = True
    words = "every position of the whole window (bidirectional: one sample per position t, S of all the window's tokens)"

    def queries(self, X: np.ndarray, offsets: np.ndarray, normalize: str = "none") -> Queries:
        upper, _ = _windows(X, offsets, normalize)
        lengths = np.diff(np.asarray(offsets, dtype=np.int64))
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
                out.upper, out.lengths, out.xx = out.upper[keep], lengths[keep], out.xx[keep]
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


LAST: Samples = _Last()
CAUSAL: Samples = _Causal()
BIDIRECTIONAL: Samples = _Bidirectional()
LAYOUTS: dict[str, Samples] = {s.name: s for s in (LAST, CAUSAL, BIDIRECTIONAL)}
# The values of `--attention` / the files' `attention` attribute: how per-position samples are read.
ATTENTIONS = tuple(s.attention for s in LAYOUTS.values() if s.attention is not None)


def named(name: str) -> Samples:
    """The layout of a name ("last", "causal", "bidirectional")."""
    try:
        return LAYOUTS[name]
    except KeyError:
        raise InputError(f"unknown sample layout {name!r}, expected one of {', '.join(LAYOUTS)}") from None


def check_attention(attention: str | None, what: str = "attention", path: Any = None) -> str | None:
    """A valid `attention` value (`ATTENTIONS`: "causal", "bidirectional") or None; `what` and `path` name it in
    the InputError."""
    if attention is not None and attention not in ATTENTIONS:
        raise InputError(f"{what} is {attention!r}, expected {' or '.join(ATTENTIONS)}", path)
    return attention


def samples_of(per_position: bool, attention: str | None = None) -> Samples:
    """The layout of data with per-position targets or not, read with `attention` (None: causal)."""
    if not per_position:
        if attention not in (None, CAUSAL.attention):
            raise InputError(f"attention {attention!r} applies to per-position samples (targets at every "
                             "position: per_position=True)")
        return LAST
    return LAYOUTS[check_attention(attention) or CAUSAL.name]


def from_attrs(attrs: Any, path: Any = None) -> Samples:
    """The layout recorded in a file's attributes (`Samples.attrs`): `per_position` (0/1) and `attention`;
    files without `attention` are causal when per-position (the attribute is optional; causal is its default)."""
    per_position = bool(int(attrs.get("per_position", 0)))
    attention = attrs.get("attention")
    if isinstance(attention, bytes):
        attention = attention.decode()
    if attention is not None:
        attention = check_attention(str(attention), "attribute 'attention'", path)
        if not per_position:
            raise InputError(f"attribute 'attention' is {attention!r} but 'per_position' is 0: attention applies "
                             "to per-position samples only; the file is inconsistent", path)
    return samples_of(per_position, attention)
