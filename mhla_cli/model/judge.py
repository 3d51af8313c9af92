"""The in-model judgement of a replacement (optional: torch): the original model against the spliced one on texts.

`judge(original, spliced, texts, tokenizer)` gives a `Judgement`: the mean and worst cosine of each text's sentence
embedding (the last hidden states mean-pooled over the attention mask and L2-normalised, as sentence-transformers'
all-MiniLM-L6-v2 pools) to the original's, the Spearman correlation of the similarities of every pair of texts with
the original's, and for a causal language model (its output has logits) with an `ablated` splice, the cross-entropy
loss recovered (L_ablated - L_spliced) / (L_ablated - L_original), the ablation stated (zero or mean: the
convention interpretability tools report). `original`, `spliced` and `ablated` are models, or splices
(`mhla_cli.model.splice.Splice`) of the original, attached while they run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import InputError

# Texts per forward pass of `judge` (padded to the longest of each batch).
BATCH_SIZE = 32
# Below this |L_ablated - L_original| the loss recovered is undefined (None): the ablation changes nothing.
LOSS_GAP_MIN = 1e-12


@dataclass(frozen=True)
class Judgement:
    """The original model against the spliced one: embeddings' cosines, Spearman of pair similarities, loss
    recovered (None when not measured: a model without logits, no ablation, or fewer than 3 texts for Spearman)."""

    n_texts: int
    mean_cosine: float
    worst_cosine: float
    spearman: float | None
    loss_original: float | None = None
    loss_spliced: float | None = None
    loss_ablated: float | None = None
    loss_recovered: float | None = None
    ablation: str | None = None


@contextlib.contextmanager
def _running(model: Any) -> Iterator[Any]:
    """The model to call: a model itself, or a splice's model with the splice attached for the block."""
    if hasattr(model, "attach") and hasattr(model, "model"):
        with model:
            yield model.model
    else:
        yield model


def _batches(texts: Sequence[str] | None, tokenizer: Any, batches: Sequence[dict] | None,
             batch_size: int) -> list[dict]:
    if batches is not None:
        return list(batches)
    if texts is None or tokenizer is None:
        raise InputError("judge needs texts and a tokenizer, or batches")
    return [dict(tokenizer(list(texts[i:i + batch_size]), return_tensors="pt", padding=True))
            for i in range(0, len(texts), batch_size)]


def run_model(model: Any, batches: list[dict]) -> tuple[np.ndarray, tuple[float, float] | None]:
    """The sentence embeddings (N, D) of every batch's rows (mean-pooled over the attention mask, L2-normalised,
    float64) and, for a model with logits, (the summed next-token cross-entropy, the number of predicted tokens)."""
    import torch

    embs, total, count, has_logits = [], 0.0, 0.0, True
    with _running(model) as m, torch.no_grad():
        for b in batches:
            ids = b["input_ids"]
            mask = b.get("attention_mask")
            mask = torch.ones_like(ids) if mask is None else mask
            out = m(**b, output_hidden_states=True)
            hidden = getattr(out, "last_hidden_state", None)
            hidden = out.hidden_states[-1] if hidden is None else hidden
            w = mask.to(torch.float64).unsqueeze(-1)
            e = (hidden.double() * w).sum(dim=1) / w.sum(dim=1).clamp(min=1.0)
            embs.append((e / e.norm(dim=1, keepdim=True)).numpy())
            logits = getattr(out, "logits", None)
            if logits is None:
                has_logits = False
                continue
            logp = torch.log_softmax(logits[:, :-1].double(), dim=-1)
            nll = -logp.gather(-1, ids[:, 1:].unsqueeze(-1)).squeeze(-1)
            keep = (mask[:, 1:] * mask[:, :-1]).double()
            total += float((nll * keep).sum())
            count += float(keep.sum())
    return np.concatenate(embs), ((total, count) if has_logits and count > 0 else None)


def pair_similarities(emb: np.ndarray) -> np.ndarray:
    """The cosine similarity of every pair i < j of L2-normalised embeddings (N, D)."""
    i, j = np.triu_indices(len(emb), 1)
    return np.einsum("ij,ij->i", emb[i], emb[j])


def _ranks(a: np.ndarray) -> np.ndarray:
    """Ranks 1..n of a, ties given their mean rank."""
    order = np.argsort(a, kind="stable")
    ranks = np.empty(a.size)
    ranks[order] = np.arange(1, a.size + 1)
    _, inverse, counts = np.unique(a, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=ranks)
    return sums[inverse] / counts[inverse]


def spearman(a: np.ndarray, b: np.ndarray) -> float | None:
    """Spearman's rank correlation of a and b (None for fewer than 2 values or a constant one)."""
    if a.size < 2:
        return None
    ra, rb = _ranks(np.asarray(a, dtype=np.float64)), _ranks(np.asarray(b, dtype=np.float64))
    ra, rb = ra - ra.mean(), rb - rb.mean()
    den = float(np.sqrt((ra @ ra) * (rb @ rb)))
    return None if den == 0.0 else float(ra @ rb) / den


def loss_recovered(original: float, spliced: float, ablated: float) -> float | None:
    """(L_ablated - L_spliced) / (L_ablated - L_original): 1 when the splice keeps the model's loss, 0 when it is
    no better than the ablation; None when the ablation changes the loss by less than LOSS_GAP_MIN."""
    gap = ablated - original
    return None if abs(gap) < LOSS_GAP_MIN else (ablated - spliced) / gap


def judge(original: Any, spliced: Any, texts: Sequence[str] | None = None, tokenizer: Any = None, *,
          ablated: Any = None, batches: Sequence[dict] | None = None, batch_size: int = BATCH_SIZE) -> Judgement:
    """The spliced model against the original on `texts` (tokenized by `tokenizer`, padded batches of `batch_size`)
    or on `batches` (dicts of input_ids (B, n) and attention_mask). `ablated`: the model with the replaced part
    ablated (`mhla_cli.model.splice.ablate`), for the loss recovered of a model with logits."""
    bs = _batches(texts, tokenizer, batches, int(batch_size))
    if not bs:
        raise InputError("judge needs at least one text")
    base, loss_o = run_model(original, bs)
    emb, loss_s = run_model(spliced, bs)
    cos = np.einsum("ij,ij->i", emb, base)
    rho = spearman(pair_similarities(base), pair_similarities(emb)) if len(base) >= 3 else None
    losses: dict[str, Any] = {}
    if ablated is not None and loss_o is not None and loss_s is not None:
        _, loss_a = run_model(ablated, bs)
        lo, ls, la = (v[0] / v[1] for v in (loss_o, loss_s, loss_a))  # type: ignore[index]
        losses = {"loss_original": lo, "loss_spliced": ls, "loss_ablated": la,
                  "loss_recovered": loss_recovered(lo, ls, la),
                  "ablation": getattr(ablated, "label", "ablated")}
    elif loss_o is not None and loss_s is not None:
        losses = {"loss_original": loss_o[0] / loss_o[1], "loss_spliced": loss_s[0] / loss_s[1]}
    return Judgement(n_texts=int(len(base)), mean_cosine=float(cos.mean()), worst_cosine=float(cos.min()),
                     spearman=rho, **losses)
