"""model.py against references: transformers' LlamaForCausalLM for logits and greedy generation (loaded through
hf.load_model), single-document runs for packed rows, full-logit cross-entropy for the chunked loss, a stand-in
flash_attn module for the varlen contract, a full recompute for the KV cache; config.json round trips with only
Hugging Face keys; the one target-matching rule that quant.quantize_ and lora.add_lora_ share; and an adapted
lm_head, which the chunked loss refuses in one line.

Every comparison runs in fp32 on tiny random models, so it is fast and exact up to float rounding.
"""

import dataclasses
import json
import math
import sys
import types

import pytest
import torch
import torch.nn.functional as F
import transformers

import lora
import model as M
import quant
from hf import load_model
from model import KVCache, Llama, LlamaConfig, generate

LLAMA3 = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16
)
CONFIGS = {
    "mha_untied_default_rope": dict(num_attention_heads=4, num_key_value_heads=4),
    "gqa_tied_llama3": dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, rope_parameters=LLAMA3
    ),
    "gqa_head_dim_linear_sharded": dict(
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, rope_parameters=dict(rope_type="linear", factor=4.0)
    ),
}


def hf_model(**kw):
    """A tiny random transformers Llama whose weights are large enough to give varied logits."""
    kw.setdefault("rope_parameters", {"rope_type": "default"})
    kw["rope_parameters"] = {"rope_theta": 500.0, **kw["rope_parameters"]}
    cfg = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        max_position_embeddings=256,
        initializer_range=0.3,
        attn_implementation="eager",
        **kw,
    )
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norm weights start at 1; randomise them so a missed multiplication shows
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return hf


def to_classic_form(path):
    """Rewrite a transformers-5 config.json (rope_parameters) the way published checkpoints spell RoPE."""
    d = json.loads((path / "config.json").read_text())
    rope = d.pop("rope_parameters")
    d["rope_theta"] = rope.pop("rope_theta")
    kind = rope.pop("rope_type")
    if kind != "default":  # Llama 2 era files say "type", Llama 3.1 files "rope_type"
        d["rope_scaling"] = {"type" if kind == "linear" else "rope_type": kind, **rope}
    (path / "config.json").write_text(json.dumps(d))


@pytest.mark.parametrize("form", ["rope_parameters", "classic"])
@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match_transformers(tmp_path, name, form):
    hf = hf_model(**CONFIGS[name])
    sharded = name.endswith("sharded")
    hf.save_pretrained(tmp_path, max_shard_size="20KB" if sharded else "50GB")
    assert (tmp_path / "model.safetensors.index.json").exists() == sharded
    if form == "classic":
        to_classic_form(tmp_path)
    ours = load_model(tmp_path)
    assert ours.lm_head.weight.dtype == torch.float32
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == hf.config.tie_word_embeddings
    ids = torch.randint(0, 97, (2, 40))
    far = torch.arange(100, 140).expand(2, 40)  # past original_max_position_embeddings: all llama3 bands in play
    with torch.no_grad():
        for pos in (None, far):
            ref = hf(ids, position_ids=pos).logits
            assert (ours(ids, pos) - ref).abs().max() < 1e-4
        # to_hf(): transformers reads our config.json back into the same model
        hf2 = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_dict(ours.config.to_hf())).eval()
        hf2.load_state_dict(ours.state_dict())
        assert (hf2(ids, position_ids=far).logits - ref).abs().max() < 1e-4


def tiny_config(**kw):
    base = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
    return LlamaConfig(**{**base, "num_key_value_heads": 2, "head_dim": 8, "eos_token_id": 2, **kw})


def packed_batch():
    """Two rows of 15 tokens: row 0 holds documents of 5, 3 and 7 tokens; row 1 continues a document (positions
    3..6) and then holds one of 11 tokens."""
    pos = torch.tensor([list(range(5)) + list(range(3)) + list(range(7)), list(range(3, 7)) + list(range(11))])
    spans = [(0, 0, 5), (0, 5, 8), (0, 8, 15), (1, 0, 4), (1, 4, 15)]  # (row, start, end)
    return torch.randint(0, 97, (2, 15)), pos, spans


def test_packed_rows_match_documents_alone():
    model = Llama(tiny_config()).eval()
    ids, pos, spans = packed_batch()
    with torch.no_grad():
        packed = model(ids, pos)
        for row, s, e in spans:
            alone = model(ids[row : row + 1, s:e], pos[row : row + 1, s:e])[0]
            assert (packed[row, s:e] - alone).abs().max() < 1e-5
        # without position_ids each row is one causal sequence
        assert (model(ids[:1]) - model(ids[:1], torch.arange(15)[None])).abs().max() < 1e-5


def test_chunked_loss_and_grads():
    model = Llama(tiny_config(num_hidden_layers=3))
    model.loss_chunk = 4  # 21 supervised tokens -> 6 chunks, the last one partial
    ids, pos, _ = packed_batch()
    labels = torch.randint(0, 97, (2, 15))
    labels[torch.rand(2, 15) < 0.3] = -100

    def run(fn):
        model.zero_grad()
        loss = fn()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    ref_loss, ref_grads = run(
        lambda: F.cross_entropy(model(ids, pos).flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    )
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        loss, n = model(ids, pos, labels=labels)
    assert n == int((labels != -100).sum()) and loss.dtype == torch.float32
    assert not [s for s in saved if s[-1] == 97], "vocabulary-wide logits were kept for the backward pass"
    for checkpointed in (False, True):
        model.activation_checkpointing = checkpointed
        got_loss, got_grads = run(lambda: model(ids, pos, labels=labels)[0])
        assert torch.allclose(got_loss, ref_loss, rtol=1e-5)
        for g, r in zip(got_grads, ref_grads, strict=True):
            assert torch.allclose(g, r, atol=1e-5, rtol=1e-4)
    model.loss_chunk = 0  # the naive full-logits path gives the same loss and gradients
    got_loss, got_grads = run(lambda: model(ids, pos, labels=labels)[0])
    assert torch.allclose(got_loss, ref_loss, rtol=1e-5)
    for g, r in zip(got_grads, ref_grads, strict=True):
        assert torch.allclose(g, r, atol=1e-5, rtol=1e-4)
    model.loss_chunk = 4
    # nothing supervised: zero loss that still backpropagates
    loss, n = model(ids, pos, labels=torch.full_like(labels, -100))
    loss.backward()
    assert n == 0 and loss.item() == 0.0


def test_flash_varlen_contract(monkeypatch):
    calls = []

    def fake_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal=False):
        calls.append((cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, q.shape, k.shape, v.shape))
        out = torch.empty_like(q)
        b = cu_seqlens_q.tolist()
        for s, e in zip(b[:-1], b[1:], strict=True):  # per document: causal softmax, k/v heads shared by groups
            rep = q.shape[1] // k.shape[1]
            qd, kd, vd = q[s:e].transpose(0, 1), k[s:e].repeat_interleave(rep, 1), v[s:e].repeat_interleave(rep, 1)
            scores = qd @ kd.permute(1, 2, 0) / math.sqrt(q.shape[-1])
            scores = scores.masked_fill(~torch.ones(e - s, e - s, dtype=torch.bool).tril(), float("-inf"))
            out[s:e] = (scores.softmax(-1) @ vd.transpose(0, 1)).transpose(0, 1)
        return out

    monkeypatch.setitem(
        sys.modules, "flash_attn", types.SimpleNamespace(flash_attn_varlen_func=fake_flash_attn_varlen_func)
    )
    _, pos, _ = packed_batch()
    docs = M.doc_bounds(pos)
    q, k, v = torch.randn(30, 4, 8), torch.randn(30, 2, 8), torch.randn(30, 2, 8)
    out = M.flash_varlen(q, k, v, docs)
    (cu_q, cu_k, max_q, max_k, causal, qs, ks, vs) = calls[0]
    assert cu_q.dtype == cu_k.dtype == torch.int32 and cu_q.tolist() == cu_k.tolist() == [0, 5, 8, 15, 19, 30]
    assert type(max_q) is int and max_q == max_k == 11 and causal is True
    assert qs == (30, 4, 8) and ks == vs == (30, 2, 8)
    assert (out - M.sdpa_varlen(q, k, v, docs)).abs().max() < 1e-5


def test_kv_cache_generation_matches_full_recompute():
    model = Llama(tiny_config()).eval()
    prompt = [5, 17, 3, 60, 8]
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(12):
            ids.append(int(model(torch.tensor([ids]))[0, -1].argmax()))
    new = ids[len(prompt) :]
    assert generate(model, prompt, 12) == new
    # the cache contract itself: a sequence fed in two chunks (the second after 9 cached tokens) gives the full-pass
    # logits
    cache = KVCache(model.config, 17)
    seq = torch.tensor([ids])
    with torch.no_grad():
        first = model(seq[:, :9], cache=cache)
        assert cache.length == 9
        chunked = torch.cat([first, model(seq[:, 9:], cache=cache)], dim=1)
        assert (chunked - model(seq)).abs().max() < 1e-5
    assert generate(model, prompt, 12, eos_id=[96, new[3]]) == new[: new.index(new[3]) + 1]
    # nucleus sampling with a vanishing top_p keeps only the most likely token
    assert generate(model, prompt, 12, temperature=0.7, top_p=1e-9, seed=1) == new
    sampled = generate(model, prompt, 12, temperature=1.0, seed=3)
    assert sampled == generate(model, prompt, 12, temperature=1.0, seed=3) and len(sampled) == 12


def test_greedy_generation_matches_transformers(tmp_path):
    hf = hf_model(num_attention_heads=4, num_key_value_heads=2, eos_token_id=7)
    hf.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    prompt = [1, 40, 41, 9, 13, 77]
    ref = hf.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, pad_token_id=0)[0, len(prompt) :]
    assert generate(ours, prompt, 20, eos_id=ours.config.eos_token_id) == ref.tolist()


def test_to_hf_writes_only_config_keys():
    """config.json carries the Hugging Face keys and nothing a fork stores on the config object."""
    cfg = tiny_config(rope_scaling=dict(rope_type="linear", factor=2.0))
    cfg.my_experiment = "not a config key"
    d = cfg.to_hf()
    assert "my_experiment" not in d
    fields = {f.name for f in dataclasses.fields(LlamaConfig)}
    assert set(d) == fields | {"architectures", "model_type", "hidden_act"}
    assert LlamaConfig.from_hf(d) == tiny_config(rope_scaling=dict(rope_type="linear", factor=2.0))
    hf_cfg = transformers.LlamaConfig.from_dict(d)  # transformers reads every key it needs
    assert (hf_cfg.head_dim, hf_cfg.num_key_value_heads, hf_cfg.rope_parameters["factor"]) == (8, 2, 2.0)


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "layers.1.mlp.up_proj"], ["o_proj", "lm_head"]])
def test_quantize_and_lora_pick_the_same_linears(targets):
    """quant.quantize_ and lora.add_lora_ follow the one rule of model.find_linears."""
    quantized = quant.quantize_(Llama(tiny_config()), targets, compute_dtype=torch.float32)
    adapted = Llama(tiny_config())
    lora.add_lora_(adapted, targets, r=2, alpha=4, dropout=0.0)
    nf4 = {n for n, m in quantized.named_modules() if isinstance(m, quant.NF4Linear)}
    assert nf4 == set(lora.lora_modules(adapted)) == set(M.find_linears(Llama(tiny_config()), targets))
    assert ("lm_head" in nf4) == ("lm_head" in targets)
    for typo in (["q_prj"], ["layers.7.mlp.up_proj"]):  # a name that matches nothing is an error in both
        with pytest.raises(ValueError, match=f"target module '{typo[0]}' matches no linear layer"):
            quant.quantize_(Llama(tiny_config()), typo)
        with pytest.raises(ValueError, match=f"add_lora_: target module '{typo[0]}' matches no linear layer"):
            lora.add_lora_(Llama(tiny_config()), typo, r=2, alpha=4, dropout=0.0)


def test_adapted_lm_head_needs_the_full_logits_loss():
    """LoRA on lm_head: the chunked loss refuses it in one line; with loss_chunk=0 it trains (lm_head's A and B get
    gradients) and gives the full-logits loss."""
    model = Llama(tiny_config())
    lora.add_lora_(model, ["lm_head", "q_proj"], r=2, alpha=4, dropout=0.0)
    ids, pos, _ = packed_batch()
    labels = torch.randint(0, 97, (2, 15))
    with pytest.raises(ValueError, match="lm_head is a LoRALinear: the chunked loss needs a plain nn.Linear head") as e:
        model(ids, pos, labels=labels)
    assert "\n" not in str(e.value)
    model.loss_chunk = 0
    loss, n = model(ids, pos, labels=labels)
    loss.backward()
    ref = F.cross_entropy(model(ids, pos).flatten(0, 1), labels.flatten(), reduction="sum")
    assert n == 30 and torch.allclose(loss, ref)
    assert model.lm_head.lora_A.weight.grad is not None and model.lm_head.lora_B.weight.grad.abs().max() > 0
