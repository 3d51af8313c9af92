"""mhla_cli.model.judge against numpy and scipy: the embeddings' cosines (mean pooling over the attention mask),
the Spearman of pair similarities (scipy.stats.spearmanr) and the loss recovered (numpy's log-softmax of the
logits each model gives), on tiny randomly initialised models with padded batches."""

from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import spearmanr

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from mhla_cli import InputError  # noqa: E402
from mhla_cli.model.heads import Heads  # noqa: E402
from mhla_cli.model.judge import LOSS_GAP_MIN, Judgement, judge, loss_recovered, spearman  # noqa: E402
from mhla_cli.model.splice import ablate, splice  # noqa: E402

TOL = 1e-9
IDS = torch.tensor([[5, 6, 7, 8, 9], [11, 12, 13, 0, 0], [14, 15, 16, 17, 0], [20, 21, 0, 0, 0]])
MASK = (IDS != 0).long()
BATCHES = [{"input_ids": IDS[:2], "attention_mask": MASK[:2]}, {"input_ids": IDS[2:], "attention_mask": MASK[2:]}]


def _heads(d_out: int, attention: str) -> Heads:
    rng = np.random.default_rng(0)
    return Heads(V=0.3 * rng.normal(size=(2, d_out, 16)), Q=0.3 * rng.normal(size=(2, 16, 16)),
                 info={"attention": attention})


def _outputs(model, spl=None):
    """(hidden (N, n, D), logits or None) of the whole batch, numpy float64."""
    with torch.no_grad():
        if spl is not None:
            spl.attach()
        try:
            out = model(input_ids=IDS, attention_mask=MASK, output_hidden_states=True)
        finally:
            if spl is not None:
                spl.remove()
    logits = getattr(out, "logits", None)
    return out.hidden_states[-1].double().numpy(), None if logits is None else logits.double().numpy()


def _embed(hidden):
    m = MASK.numpy()[..., None].astype(float)
    e = (hidden * m).sum(1) / m.sum(1)
    return e / np.linalg.norm(e, axis=1, keepdims=True)


def _loss(logits):
    z = logits[:, :-1] - logits[:, :-1].max(-1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(-1, keepdims=True))
    ids, m = IDS.numpy(), MASK.numpy()
    nll = -np.take_along_axis(logp, ids[:, 1:, None], -1)[..., 0]
    keep = m[:, 1:] * m[:, :-1]
    return float((nll * keep).sum() / keep.sum())


def _pairs(e):
    i, j = np.triu_indices(len(e), 1)
    return (e[i] * e[j]).sum(1)


def test_bert_cosines_and_spearman_against_numpy():
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=4,
                                  intermediate_size=32)
    torch.manual_seed(0)
    model = transformers.BertModel(cfg).eval()
    spl = splice(model, _heads(4, "bidirectional"), 1, 2)
    j = judge(model, spl, batches=BATCHES)
    base, emb = _embed(_outputs(model)[0]), _embed(_outputs(model, spl)[0])
    cos = (base * emb).sum(1)
    assert isinstance(j, Judgement) and j.n_texts == 4
    assert abs(j.mean_cosine - cos.mean()) <= TOL and abs(j.worst_cosine - cos.min()) <= TOL
    assert abs(j.spearman - spearmanr(_pairs(base), _pairs(emb)).statistic) <= TOL
    assert j.loss_recovered is None and j.ablation is None  # no logits
    assert not spl.attached  # judge attached it while it ran, and only then


def test_gpt2_loss_recovered_against_numpy():
    cfg = transformers.GPT2Config(vocab_size=50, n_embd=16, n_layer=2, n_head=4, n_positions=32)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()
    spl, abl = splice(model, _heads(4, "causal"), 1, 1), ablate(model, 1, 1)
    j = judge(model, spl, batches=BATCHES, ablated=abl)
    lo, ls, la = (_loss(_outputs(model, s)[1]) for s in (None, spl, abl))
    assert abs(j.loss_original - lo) <= TOL and abs(j.loss_spliced - ls) <= TOL and abs(j.loss_ablated - la) <= TOL
    assert abs(j.loss_recovered - (la - ls) / (la - lo)) <= 1e-6
    assert j.ablation == "zero-ablated"
    mean = judge(model, spl, batches=BATCHES, ablated=ablate(model, 1, 1, mean=np.ones(4)))
    assert mean.ablation == "mean-ablated"
    same = judge(model, model, batches=BATCHES, ablated=model)  # no gap: undefined, not a division by zero
    assert same.loss_recovered is None and LOSS_GAP_MIN > 0


def test_texts_through_a_tokenizer():
    class Tok:  # a tokenizer's call: padded input_ids and attention_mask
        def __call__(self, texts, return_tensors, padding):
            rows = [[5 + len(w) for w in t.split()] for t in texts]
            n = max(map(len, rows))
            return {"input_ids": torch.tensor([r + [0] * (n - len(r)) for r in rows]),
                    "attention_mask": torch.tensor([[1] * len(r) + [0] * (n - len(r)) for r in rows])}

    cfg = transformers.BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=4,
                                  intermediate_size=32)
    model = transformers.BertModel(cfg).eval()
    j = judge(model, model, ["a bb ccc", "dddd e", "ff ggg hhhh iiiii", "j"], Tok(), batch_size=3)
    assert j.n_texts == 4 and abs(j.mean_cosine - 1) <= TOL and abs(j.spearman - 1) <= TOL
    with pytest.raises(InputError, match="texts and a tokenizer"):
        judge(model, model, ["x"])


@pytest.mark.parametrize("seed", range(5))
def test_spearman_with_ties_equals_scipy(seed):
    rng = np.random.default_rng(seed)
    a, b = rng.integers(0, 4, 30).astype(float), rng.normal(size=30)
    assert abs(spearman(a, b) - spearmanr(a, b).statistic) <= TOL
    assert spearman(np.ones(5), b[:5]) is None and spearman(a[:1], b[:1]) is None


def test_loss_recovered_at_its_cut() -> None:
    """Just outside LOSS_GAP_MIN the ratio is defined (and exact); just inside it is None."""
    gap = 2 * LOSS_GAP_MIN
    assert loss_recovered(3.0, 3.0 + gap / 4, 3.0 + gap) == pytest.approx(0.75, rel=1e-3)
    assert loss_recovered(3.0, 3.0, 3.0 + LOSS_GAP_MIN / 2) is None
    assert loss_recovered(2.0, 2.5, 3.0) == 0.5 and loss_recovered(2.0, 3.0, 3.0) == 0.0
