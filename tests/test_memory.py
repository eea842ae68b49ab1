"""support/accounting/memory.py's estimate against what torch really allocates, on tiny models:

- the weight bytes equal a real QLoRA model's NF4 buffers plus its 16-bit tensors, and the adapter bytes its trainable
  parameters, for several targets and a tied and an untied head;
- the activation bytes equal (within 10%) the bytes autograd really saves for backward in a forward pass, with and
  without LoRA dropout, with activation checkpointing (its block inputs offloaded or not) and with a tiled MLP, counted
  with saved-tensor hooks;
- sharded over N ranks, each holds 1/N of the weights and the adapters' state (none when offloaded) and gathers the
  root and two blocks.

(The estimate printed by train.py is checked against the measured peak of the default run in test_train.py.)
"""

import pytest
import torch

import lora
import quant
import train
from model import LOSS_CHUNK, Llama, LlamaConfig, Options
from support.accounting import memory

CFG = dict(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4)


def config(**kw):
    return LlamaConfig(**{**CFG, "num_key_value_heads": 2, "head_dim": 16, **kw})


def adapters(r, targets, dropout):
    """The LoRA settings train.Config.adapters gives memory.estimate (targets: "all-linear" or a list of names)."""
    names = targets if isinstance(targets, str) else ",".join(targets)
    return train.Config(lora_r=r, lora_alpha=2.0 * r, lora_targets=names).adapters(dropout)


def qlora(cfg, targets, dropout, dtype=torch.bfloat16, **options):
    torch.manual_seed(0)
    model = quant.quantize_(Llama(cfg, options=Options(**options)).to(dtype), compute_dtype=dtype)
    lora.add_lora_(model, targets, r=4, alpha=8, dropout=dropout, lora_dtype=torch.float32)
    return model


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj", "down_proj"]])
def test_weights_and_adapters_equal_a_real_model(tied, targets):
    """The weight bytes are a real QLoRA model's NF4 buffers and 16-bit tensors (a tied head once), and those of a
    16-bit base two per parameter; the adapters, their gradients and AdamW's state are 4, 4 and 8 bytes a parameter."""
    cfg = config(tie_word_embeddings=tied)
    model = qlora(cfg, targets, 0.0)
    tensors = {t.data_ptr(): t for t in [*model.parameters(), *model.buffers()]}  # a tied head once
    frozen = sum(t.numel() * t.element_size() for t in tensors.values() if not t.requires_grad)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    est = memory.estimate(cfg, 64, torch.bfloat16, True, adapters(4, targets, 0.0), 8, False)
    assert est["weights"] == frozen
    assert est["adapters"] == est["gradients"] == 4 * trainable and est["optimizer"] == 8 * trainable
    dense = memory.estimate(cfg, 64, torch.bfloat16, False, adapters(4, targets, 0.0), 8, False)
    assert dense["weights"] == 2 * sum(p.numel() for p in Llama(cfg).parameters())


def saved_bytes(model, ids, pos, labels):
    """Bytes of the distinct storages autograd saves during one forward, leaving out the model's own tensors."""
    own = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers()]}
    seen = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            seen[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        loss, _ = model(ids, pos, labels=labels)
    return sum(seen.values()), loss


@pytest.mark.parametrize(
    "dropout, checkpointing, chunked, tile, offload",
    [(0.0, False, True, 0, False), (0.1, False, True, 0, False), (0.1, True, True, 0, False),
     (0.0, False, False, 0, False), (0.1, False, True, 64, False), (0.1, True, True, 0, True)],
)  # fmt: skip
def test_activations_equal_what_autograd_saves(dropout, checkpointing, chunked, tile, offload):
    """The activations part is what the hooks see (the transient part, the loss chunk, a dequantized weight and the
    block checkpointing recomputes, lives only while its step runs); the full-vocabulary loss keeps its logits; a
    tiled MLP (64-token tiles) keeps none of the MLP's intermediates; offloaded checkpoints none of the block inputs
    (the model's own saved-tensor hooks take them, not the test's)."""
    cfg, tokens = config(num_hidden_layers=4, vocab_size=2048), 256
    options = dict(checkpointing=checkpointing, loss_chunk=LOSS_CHUNK if chunked else 0, mlp_tile=tile)
    model = qlora(cfg, "all-linear", dropout, offload_checkpoints=offload, **options).train()
    pos = torch.cat([torch.arange(n) for n in (100, 60, 96)])[None]
    ids, labels = torch.randint(0, 128, (1, tokens)), torch.randint(0, 128, (1, tokens))
    got, loss = saved_bytes(model, ids, pos, labels)
    args = (cfg, tokens, torch.bfloat16, True, adapters(4, "all-linear", dropout), 8, checkpointing)
    options = dict(chunked=chunked, tile_tokens=tile, offload_checkpoints=offload, dropout_masks=True)  # CPU: masks
    want = memory.estimate(*args, **options)["activations"]
    assert abs(got - want) <= 0.1 * got, (got, want)
    loss.backward()  # the model really trains from what was saved


def test_the_sharded_estimate():
    """FSDP over N ranks: each holds 1/N of the weights, adapters, gradients and optimizer state (none of it on the GPU
    when offloaded) plus what it gathers, the root's weights and two blocks; activations are every rank's own."""
    cfg, lora = config(num_hidden_layers=16, hidden_size=256, intermediate_size=640), adapters(4, "all-linear", 0.05)
    whole = memory.estimate(cfg, 512, torch.bfloat16, True, lora, 8, True)
    for shards, offload in [(2, False), (4, False), (4, True)]:
        part = memory.estimate(cfg, 512, torch.bfloat16, True, lora, 8, True, shards=shards, offload=offload)
        for key in ("weights", "adapters", "gradients", "optimizer"):
            assert part[key] == (0 if offload else int(whole[key] / shards)), key
        assert part["activations"] == whole["activations"] and part["transient"] == whole["transient"]
        root = 2 * cfg.vocab_size * cfg.hidden_size * 2 + 2 * cfg.hidden_size  # embeddings, lm_head, final norm
        assert part["gathered"] == int(root + 2 * (whole["weights"] - root + whole["adapters"]) / 16)
