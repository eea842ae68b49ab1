"""memory.py against what torch really allocates, on tiny models:

- the weight bytes equal a real QLoRA model's NF4 buffers plus its 16-bit tensors, and the adapter bytes its trainable
  parameters, for several targets and a tied and an untied head;
- the activation bytes equal (within 10%) the bytes autograd really saves for backward in a forward pass, with and
  without LoRA dropout and with activation checkpointing, counted with saved-tensor hooks;
- the micro-batch probe finds the largest size that fits under a simulated out-of-memory allocator, frees each
  failed attempt before the next and resets the peak statistics;
- the plan follows the decision tree: for budgets cut between the table's own entries it picks the 16-bit base, then
  NF4, then 8-bit AdamW, checkpointing only when one row does not fit without it, and the largest micro-batch that
  fits; a budget below everything gets no choice; unknown GPU names are one line.

(The estimate printed by train.py is checked against the measured peak of the default run in test_train.py.)
"""

import pytest
import torch

import lora
import quant
import train
from model import LOSS_CHUNK, Llama, LlamaConfig
from support import memory

CFG = dict(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4)


def config(**kw):
    return LlamaConfig(**{**CFG, "num_key_value_heads": 2, "head_dim": 16, **kw})


def adapters(r, targets, dropout):
    """The LoRA settings train.Config.adapters gives memory.estimate (targets: "all-linear" or a list of names)."""
    names = targets if isinstance(targets, str) else ",".join(targets)
    return train.Config(lora_r=r, lora_alpha=2.0 * r, lora_dropout=dropout, lora_targets=names).adapters()


def qlora(cfg, targets, dropout, dtype=torch.bfloat16):
    torch.manual_seed(0)
    model = quant.quantize_(Llama(cfg).to(dtype), compute_dtype=dtype)
    lora.add_lora_(model, targets, r=4, alpha=8, dropout=dropout, lora_dtype=torch.float32)
    return model


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "v_proj", "down_proj"]])
def test_weights_and_adapters_equal_a_real_model(tied, targets):
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
    "dropout, checkpointing, chunked", [(0.0, False, True), (0.1, False, True), (0.1, True, True), (0.0, False, False)]
)
def test_activations_equal_what_autograd_saves(dropout, checkpointing, chunked):
    """The activations part is what the hooks see (the transient part, the loss chunk, a dequantized weight and the
    block checkpointing recomputes, lives only while its step runs); the full-vocabulary loss keeps its logits."""
    cfg, tokens = config(num_hidden_layers=4, vocab_size=2048), 256
    model = qlora(cfg, "all-linear", dropout).train()
    model.activation_checkpointing, model.loss_chunk = checkpointing, model.loss_chunk if chunked else 0
    pos = torch.cat([torch.arange(n) for n in (100, 60, 96)])[None]
    ids, labels = torch.randint(0, 128, (1, tokens)), torch.randint(0, 128, (1, tokens))
    got, loss = saved_bytes(model, ids, pos, labels)
    args = (cfg, tokens, torch.bfloat16, True, adapters(4, "all-linear", dropout), 8, checkpointing)
    want = memory.estimate(*args, chunked=chunked)["activations"]
    assert abs(got - want) <= 0.1 * got, (got, want)
    loss.backward()  # the model really trains from what was saved


def test_plan_follows_the_decision_tree():
    cfg = config(num_hidden_layers=4)
    plan = lambda budget: memory.plan(cfg, budget, 512, 8, torch.bfloat16, adapters(4, "all-linear", 0.05))  # noqa: E731
    table, _ = plan(0)
    between = lambda a, b: (table[a] + table[b]) / 2  # noqa: E731  (a budget just above a, below b)
    assert plan(table[False, 8, False, 8])[1] == (False, 8, False, 8)  # everything fits: the fastest
    assert plan(between((False, 8, False, 2), (False, 8, False, 4)))[1] == (False, 8, False, 2)
    budget = between((False, 8, True, 1), (False, 8, False, 1))  # 16-bit fits only with checkpointing
    assert table[False, 8, True, 1] < table[False, 8, False, 1] and plan(budget)[1][:3] == (False, 8, True)
    budget = between((True, 8, True, 1), (False, 2, True, 1))  # only NF4 fits
    assert table[True, 8, True, 1] < table[False, 2, True, 1] and plan(budget)[1][:2] == (True, 8)
    assert plan(table[True, 2, True, 1] - 1)[1] is None  # below an NF4 base, 8-bit AdamW and checkpointing
    text = memory.report(cfg, "24GB", 512, 8, torch.bfloat16, adapters(4, "all-linear", 0.05))
    assert "fastest that fits: 16-bit base, AdamW, checkpointing off, 8 row(s)" in text
    with pytest.raises(ValueError, match="plan: 'H300' is neither a size like 24GB nor a known GPU"):
        memory.budget_bytes("H300")
    assert memory.budget_bytes("80GB") == 79 * 2**30  # sizes in GB are taken as GiB; a known card is what
    assert memory.budget_bytes("H100") == 81559 * 2**20 - 2**30  # nvidia-smi reports, less than it is sold as
    full = memory.plan(cfg, 0, 512, 8, torch.bfloat16, adapters(4, "all-linear", 0.05), chunked=False)[0]
    logits = 512 * cfg.vocab_size  # per row: the full-vocabulary loss keeps 4 bytes a logit, and 8 more pass through
    assert all(
        full[k] - table[k] == 12 * k[3] * logits - 8 * min(k[3] * 512, LOSS_CHUNK) * cfg.vocab_size for k in table
    )
    assert text.splitlines()[0].endswith(", chunked loss")
    text = memory.report(cfg, "L4", 512, 8, torch.bfloat16, adapters(4, "all-linear", 0.05), chunked=False)
    assert text.splitlines()[0].endswith(", full-vocabulary loss")


@pytest.mark.parametrize("fit_up_to, max_rows", [(3, 8), (8, 8), (1, 8), (5, 6), (1, 1)])
def test_micro_batch_probe_under_simulated_oom(monkeypatch, fit_up_to, max_rows):
    """An allocator that runs out of memory above `fit_up_to` rows, after the attempt has allocated its tensors."""
    import weakref

    events, alive = [], []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: events.append("empty_cache"))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: events.append("reset_peak"))

    def attempt(rows):
        assert all(ref() is None for ref in alive), "the previous attempt's tensors are still alive"
        activations = torch.zeros(rows, 1000)
        alive.append(weakref.ref(activations))
        events.append(rows)
        if rows > fit_up_to:
            raise torch.OutOfMemoryError(f"CUDA out of memory: {rows} rows")

    assert memory.probe_micro_rows(attempt, max_rows, torch.device("cuda")) == fit_up_to
    tried = [e for e in events if isinstance(e, int)]
    assert tried[0] == max_rows and len(tried) <= 1 + max_rows.bit_length()
    assert events.count("empty_cache") == len(tried) and events[-1] == "reset_peak"


def test_sharded_estimate_and_the_plan_on_several_gpus():
    """FSDP over N ranks: each holds 1/N of the weights, adapters, gradients and optimizer state (none of it on the GPU
    when offloaded) plus what it gathers, the root's weights and two blocks; activations are every rank's own. --plan
    on several GPUs tries DDP, then FSDP (NF4 first: the base travels every step), then FSDP with CPU offload, and
    names the torchrun command."""
    cfg, lora = config(num_hidden_layers=16, hidden_size=256, intermediate_size=640), adapters(4, "all-linear", 0.05)
    whole = memory.estimate(cfg, 512, torch.bfloat16, True, lora, 8, True)
    for shards, offload in [(2, False), (4, False), (4, True)]:
        part = memory.estimate(cfg, 512, torch.bfloat16, True, lora, 8, True, shards=shards, offload=offload)
        for key in ("weights", "adapters", "gradients", "optimizer"):
            assert part[key] == (0 if offload else int(whole[key] / shards)), key
        assert part["activations"] == whole["activations"] and part["transient"] == whole["transient"]
        root = 2 * cfg.vocab_size * cfg.hidden_size * 2 + 2 * cfg.hidden_size  # embeddings, lm_head, final norm
        assert part["gathered"] == int(root + 2 * (whole["weights"] - root + whole["adapters"]) / 16)
    one, two = memory.budget_bytes("H100"), memory.budget_bytes("2xH100")
    assert one == two and memory.gpu_count("2xH100") == 2 and memory.gpu_count("H100") == 1
    table, _ = memory.plan(cfg, 0, 512, 1, torch.bfloat16, lora, shards=2, offload=False)
    budget = table[True, 8, True, 1] + 2**12  # the sharded NF4 base fits, one row, checkpointing; replicated not
    ddp = memory.plan(cfg, budget, 512, 1, torch.bfloat16, lora)[0]
    assert min(ddp.values()) > budget
    spec = f"2x{budget / 2**30 + 1:.9f}GB"  # the CUDA context (1 GiB) comes off the size given
    text = memory.report(cfg, spec, 512, 1, torch.bfloat16, lora)
    assert "-- DDP: bytes per GPU" in text and "-- FSDP: bytes per GPU" in text
    assert text.splitlines()[-1] == (
        "fastest that fits on 2 GPUs, FSDP: NF4 base, AdamW, checkpointing on, 1 row(s) per micro-batch (torchrun "
        "--nproc_per_node=2 train.py: --quantize=True --optimizer=adamw --activation_checkpointing=True "
        "--micro_batch_tokens=512 --parallel=fsdp --cpu_offload=False)"
    )
