"""support/accounting/plan.py: --plan's decision tree over the memory estimate, on tiny configs.

- the plan follows the decision tree: for budgets cut between the table's own entries it picks the 16-bit base, then
  NF4, then 8-bit AdamW, checkpointing only when one row does not fit without it, and the largest micro-batch that
  fits; a budget below everything gets no choice; unknown GPU names are one line;
- on several GPUs it tries DDP, then FSDP (NF4 first: the base travels every step), then FSDP with CPU offload, and
  names the torchrun command;
- the longest single row it prints, with checkpointing, then also a tiled MLP, then also offloaded checkpoints, is
  the longest whose estimate fits.

The micro-batch: the probe finds the largest size that fits under a simulated out-of-memory allocator, frees each failed
attempt before the next and resets the peak statistics (on a GPU, test_train.py runs the probe under a capped memory
fraction); the MLP is tiled where one row of the context does not fit untiled, and only there.
"""

import re
import weakref

import pytest
import torch
from test_memory import adapters, config

from model import LOSS_CHUNK
from support.accounting import memory, plan
from support.run import ranks


def test_plan_follows_the_decision_tree():
    """Budgets cut between the table's own entries get the fastest setting that fits (16-bit base, then NF4, then 8-bit
    AdamW; checkpointing only when one row does not fit without it; then the largest micro-batch), a budget below
    everything gets none; the report names the choice and the loss; the full-vocabulary loss costs its logits; GPU
    names and sizes become budgets, and an unknown one is one line."""
    cfg = config(num_hidden_layers=4)
    plan_in = lambda budget: plan.plan(cfg, budget, 512, 8, torch.bfloat16, adapters(4, "all-linear", 0.05))  # noqa: E731
    table, _ = plan_in(0)
    between = lambda a, b: (table[a] + table[b]) / 2  # noqa: E731  (a budget just above a, below b)
    assert plan_in(table[False, 8, False, 8])[1] == (False, 8, False, 8)  # everything fits: the fastest
    assert plan_in(between((False, 8, False, 2), (False, 8, False, 4)))[1] == (False, 8, False, 2)
    budget = between((False, 8, True, 1), (False, 8, False, 1))  # 16-bit fits only with checkpointing
    assert table[False, 8, True, 1] < table[False, 8, False, 1] and plan_in(budget)[1][:3] == (False, 8, True)
    budget = between((True, 8, True, 1), (False, 2, True, 1))  # only NF4 fits
    assert table[True, 8, True, 1] < table[False, 2, True, 1] and plan_in(budget)[1][:2] == (True, 8)
    assert plan_in(table[True, 2, True, 1] - 1)[1] is None  # below an NF4 base, 8-bit AdamW and checkpointing
    text = plan.report(cfg, "24GB", 512, 8, torch.bfloat16, adapters(4, "all-linear", 0.05))
    assert "fastest that fits: 16-bit base, AdamW, checkpointing off, 8 row(s)" in text
    with pytest.raises(ValueError, match="plan: 'H300'"):
        plan.budget_bytes("H300")
    assert plan.budget_bytes("80GB") == 79 * 2**30  # sizes in GB are taken as GiB; a known card is what
    assert plan.budget_bytes("H100") == 81559 * 2**20 - 2**30  # nvidia-smi reports, less than it is sold as
    full = plan.plan(cfg, 0, 512, 8, torch.bfloat16, adapters(4, "all-linear", 0.05), chunked=False)[0]
    logits = 512 * cfg.vocab_size  # per row: the full-vocabulary loss keeps 4 bytes a logit, and 8 more pass through
    chunk = lambda k: 8 * min(k[3] * 512, LOSS_CHUNK) * cfg.vocab_size  # noqa: E731 (the chunked loss's transient)
    # its logits kept, at least; at most also its transient over every token in place of one chunk's (the transient
    # counts the loss or a block's backward, whichever is larger)
    assert all(4 * k[3] * logits <= full[k] - table[k] <= 12 * k[3] * logits - chunk(k) for k in table)
    assert any(full[k] - table[k] == 12 * k[3] * logits - chunk(k) for k in table)
    assert text.splitlines()[0].endswith(", chunked loss")
    text = plan.report(cfg, "L4", 512, 8, torch.bfloat16, adapters(4, "all-linear", 0.05), chunked=False)
    assert text.splitlines()[0].endswith(", full-vocabulary loss")


def test_the_plan_on_several_gpus():
    """--plan on several GPUs: a budget where the sharded NF4 base fits at one row and the replicated one does not
    ends in FSDP, with its torchrun command."""
    cfg = config(num_hidden_layers=16, hidden_size=256, intermediate_size=640)
    lora = adapters(4, "all-linear", 0.05)
    one, two = plan.budget_bytes("H100"), plan.budget_bytes("2xH100")
    assert one == two and plan.gpu_count("2xH100") == 2 and plan.gpu_count("H100") == 1
    table, _ = plan.plan(cfg, 0, 512, 1, torch.bfloat16, lora, shards=2, offload=False)
    budget = table[True, 8, True, 1] + 2**12  # the sharded NF4 base fits, one row, checkpointing; replicated not
    ddp = plan.plan(cfg, budget, 512, 1, torch.bfloat16, lora)[0]
    assert min(ddp.values()) > budget
    spec = f"2x{budget / 2**30 + 1:.9f}GB"  # the CUDA context (1 GiB) comes off the size given
    text = plan.report(cfg, spec, 512, 1, torch.bfloat16, lora)
    assert "-- DDP: bytes per GPU" in text and "-- FSDP: bytes per GPU" in text
    assert text.splitlines()[-1] == (
        "fastest that fits on 2 GPUs, FSDP: NF4 base, AdamW, checkpointing on, 1 row(s) per micro-batch (torchrun "
        "--nproc_per_node=2 train.py: --quantize=True --optimizer=adamw --activation_checkpointing=True "
        "--micro_batch_tokens=512 --parallel=fsdp --cpu_offload=False)"
    )


def test_the_longest_single_row_is_the_longest_that_fits():
    """Each of the three lengths fits the budget by the estimate and 256 tokens more do not; each setting trains a
    longer row than the one before; the offloaded checkpoints' CPU memory is every block's input and RoPE's once; the
    report carries the line below its title."""
    cfg = config(num_hidden_layers=8, hidden_size=256, intermediate_size=704, max_position_embeddings=4096)
    lora, budget = adapters(8, "all-linear", 0.05), 2**30
    line = plan.longest_row(cfg, budget, torch.bfloat16, lora, True, True, 8)
    found = re.search(r"\): ([\d,]+) tokens; with a tiled MLP ([\d,]+); and offloaded checkpoints ([\d,]+)", line)
    plain, tiled, offloaded = (int(n.replace(",", "")) for n in found.groups())

    def fits(tokens, tile, offload):
        parts = memory.estimate(cfg, tokens, torch.bfloat16, True, lora, 8, True, tile_tokens=tile,
                                offload_checkpoints=offload)  # fmt: skip
        return sum(parts.values()) <= budget

    for tokens, tile, offload in [(plain, 0, False), (tiled, 256, False), (offloaded, 256, True)]:
        assert tokens % 256 == 0 and fits(tokens, tile, offload) and not fits(tokens + 256, tile, offload)
    assert plain < tiled < offloaded
    assert f"their CPU memory {memory.fmt(offloaded * 2 * (256 * 8 + 2 * 16))}" in line
    text = plan.report(cfg, "2GB", 512, 8, torch.bfloat16, lora)
    assert text.splitlines()[1] == plan.longest_row(cfg, plan.budget_bytes("2GB"), torch.bfloat16, lora, True, True, 8)


@pytest.mark.parametrize("fit_up_to, max_rows", [(3, 8), (8, 8), (1, 8), (5, 6), (1, 1)])
def test_micro_batch_probe_under_simulated_oom(monkeypatch, fit_up_to, max_rows):
    """Under an allocator that runs out of memory above `fit_up_to` rows (after the attempt has allocated its
    tensors), the probe returns fit_up_to: max_rows first, then bisection; each failed attempt's tensors are gone
    before the next, the cache is emptied after every attempt and the peak statistics are reset at the end."""
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

    assert plan.probe_micro_rows(attempt, max_rows, torch.device("cuda")) == fit_up_to
    tried = [e for e in events if isinstance(e, int)]
    assert tried[0] == max_rows and len(tried) <= 1 + max_rows.bit_length()
    assert events.count("empty_cache") == len(tried) and events[-1] == "reset_peak"


def test_the_mlp_is_tiled_where_one_row_does_not_fit_untiled(monkeypatch):
    """mlp_tile_tokens: a number is taken as it is; "auto" tiles in hidden_size tokens where the estimate of one row of
    the context fits no memory budget (here the budget answers by hand), never for a row shorter than a tile, and
    not where the row fits."""
    import train
    from model import LlamaConfig

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16)  # fmt: skip
    place = ranks.Placement(0, 1, torch.device("cpu"))
    asked = []
    monkeypatch.setattr(plan, "fits_in_memory", lambda parts, place: asked.append(parts) or False)
    assert plan.mlp_tile_tokens(train.Config(mlp_tile_tokens=96), place, config, 4096) == 96
    auto = train.Config()
    assert plan.mlp_tile_tokens(auto, place, config, 64) == 0 and not asked  # one tile holds the row
    assert plan.mlp_tile_tokens(auto, place, config, 4096) == 64 and len(asked) == 1
    monkeypatch.setattr(plan, "fits_in_memory", lambda parts, place: True)
    assert plan.mlp_tile_tokens(auto, place, config, 4096) == 0
