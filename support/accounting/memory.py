"""How much memory does a LoRA or QLoRA run take, and what did it really use?

`estimate` counts the bytes of one micro-batch on one rank by part (weights, adapters, gradients, optimizer,
activations, transient; under FSDP what is gathered), from the model's shapes alone, reading off what each module saves
for backward. `peak` measures: on CUDA the allocator's peak since `reset_peak`, which the estimate describes within 15%
(docs/performance.md); on CPU the process's peak resident set, with no such promise. Neither counts the CUDA context
(plan.py takes it off the card). docs/support.md explains each term.
"""

import math
import os

import torch
import torch.nn as nn

from model import LOSS_CHUNK, Llama, find_linears

GIB = 2**30
MIB = 2**20
MLP_LINEARS = ("gate_proj", "up_proj", "down_proj")  # what a tiled MLP recomputes tile by tile


def nf4_bytes(n):
    """Bytes of one NF4 double-quantized weight of n values (quant.NF4Weight's four buffers)."""
    blocks = math.ceil(n / 64)
    return (n + 1) // 2 + blocks + 4 * math.ceil(blocks / 256) + 4


def model_sizes(config, targets) -> dict:
    """The shapes the estimate needs, read off a Llama of `config` on the meta device. Building it is the slow part of
    an estimate (0.15 s for a 70B config), so a plan reads it once."""
    with torch.device("meta"):
        model = Llama(config)
    adapted = find_linears(model, targets, (nn.Linear,))
    return {
        "params": sum({id(p): p.numel() for p in model.parameters()}.values()),
        "block_linears": [m.weight.numel() for m in find_linears(model, "all-linear").values()],
        "adapted": sum(m.in_features + m.out_features for m in adapted.values()),
        "first_block": {
            n.rsplit(".", 1)[-1]: m.in_features for n, m in adapted.items() if n.startswith("model.layers.0.")
        },
        "root": sum(p.numel() for n, p in model.named_parameters() if not n.startswith("model.layers.")),
    }


def estimate(config, tokens, dtype, quantize, lora, opt_bytes, checkpointing, chunked=True, shards=0, offload=False,
             sizes=None, tile_tokens=0, offload_checkpoints=False, dropout_masks=False):  # fmt: skip
    """Bytes by part for a micro-batch of `tokens` tokens, on one rank. lora: train.Common.adapters; chunked=False:
    the full-vocabulary loss; shards: FSDP over that many ranks (0: not sharded), offload: its shards in CPU memory;
    sizes: model_sizes(config, lora targets); tile_tokens: tokens of one tile of a tiled MLP (0 or >= tokens: not
    tiled); offload_checkpoints: the checkpointed block inputs are in CPU memory (offloaded_bytes), not here;
    dropout_masks: LoRA's dropout keeps a byte mask per element (the reference, on CPU)."""
    sizes = sizes or model_sizes(config, lora["targets"])
    linears = sizes["block_linears"]  # the numel of each block linear
    a = torch.finfo(dtype).bits // 8  # bytes of one value in the compute dtype
    quantized = sum(linears) if quantize else 0
    weights = a * (sizes["params"] - quantized) + (sum(nf4_bytes(n) for n in linears) if quantize else 0)
    lora_numbers = lora["r"] * sizes["adapted"]
    h = config.hidden_size
    i = config.intermediate_size
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    rest, mlp = block_saves(config, sizes["first_block"], a, lora, dropout_masks)
    tile = tile_tokens if 0 < tile_tokens < tokens else 0  # tiled MLP: its intermediates live for one tile at a time
    # the loss: 8 bytes a logit (fp32, and the matmul's output or the gradient) of one chunk, or of every token
    loss = (min(tokens, LOSS_CHUNK) if chunked else tokens) * config.vocab_size * 8
    transient = max(linears) * a if quantize else 0  # W dequantized in backward
    layers = config.num_hidden_layers
    # the gradients in flight in a block's backward: its MLP's (tiled: one tile's), then attention's
    grads_mlp = (tile or tokens) * 2 * a * i + tokens * a * h
    grads_attention = tokens * (4 * h + a * h + 4 * q + a * (2 * q + 2 * kv))
    if checkpointing:  # kept: the block inputs (in CPU memory when offloaded); the block recomputed in backward
        kept = 0 if offload_checkpoints else tokens * a * h * layers
        # the recomputed block: what it saved, and its backward's larger phase (the MLP's saves go before attention's)
        live = tokens * rest + max((tile or tokens) * mlp + grads_mlp, grads_attention)
        transient += max(loss, live + (tokens * a * h if offload_checkpoints else 0))  # + its input, back from CPU
    else:  # kept: what each block saves (tiled: not its MLP's intermediates, each tile recomputed in backward)
        kept = (tokens * rest + (0 if tile else tokens * mlp)) * layers
        transient += max(loss, tile * mlp + grads_mlp, grads_attention)
    kept += 0 if chunked else tokens * config.vocab_size * 4  # the full loss keeps every fp32 logit
    parts = {
        "weights": weights,
        "adapters": 4 * lora_numbers,
        "gradients": 4 * lora_numbers,
        "optimizer": opt_bytes * lora_numbers,
        "activations": kept  # + the final norm's fp32 input, RoPE's cos/sin (offloaded with the block inputs)
        + tokens * (4 * h + (0 if checkpointing and offload_checkpoints else 2 * a * config.head_dim)),
        "transient": transient,
    }
    if shards:
        parts |= sharded(parts, a * sizes["root"], layers, shards, offload)
    return parts


def block_saves(config, first, a, lora, dropout_masks) -> tuple[int, int]:
    """(bytes a block saves per token for backward outside its MLP (norms, attention), bytes its MLP saves), with
    `a`-byte values; first: {kind: in_features} of a block's adapted linears, which keep their LoRA's inputs."""
    h = config.hidden_size
    i = config.intermediate_size
    heads = config.num_attention_heads
    q = heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    dropped = (a + dropout_masks) if lora["dropout"] > 0 else 0  # bytes a dropped input element keeps
    lora_kept = {kind: a * lora["r"] + dropped * n_in for kind, n_in in first.items()}
    mlp = 3 * a * i + sum(v for kind, v in lora_kept.items() if kind in MLP_LINEARS)  # gate, silu(gate), up, LoRA's
    mlp += a * i if lora["dropout"] == 0 and "down_proj" in first else 0  # silu(gate) * up, kept for down's LoRA
    rest = 2 * (4 * h + a * h) + a * (2 * q + 2 * kv) + 4 * heads  # the norms, attention
    rest += sum(v for kind, v in lora_kept.items() if kind not in MLP_LINEARS)
    return rest, mlp


def sharded(parts, root, layers, shards, offload) -> dict:
    """The parts a rank holds under FSDP: 1/shards of the weights, adapters, gradients and optimizer state (none of it
    on the GPU when offloaded to CPU memory), plus what is gathered: the root's weights (embeddings, final norm,
    lm_head) for the whole step, and two blocks, the one computing and the next one prefetched."""
    block = (parts["weights"] - root + parts["adapters"]) / layers
    keep = 0 if offload else 1 / shards
    held = {k: int(parts[k] * keep) for k in ("weights", "adapters", "gradients", "optimizer")}
    return held | {"gathered": int(root + 2 * block)}


def offloaded_bytes(config, tokens, dtype) -> int:
    """CPU memory offloaded checkpoints take: every block's input, and RoPE's cos and sin once."""
    a = torch.finfo(dtype).bits // 8
    return tokens * a * (config.hidden_size * config.num_hidden_layers + 2 * config.head_dim)


def optimizer_bytes(optimizer) -> int:
    """Optimizer state per trainable parameter: AdamW's two fp32 moments, or two 8-bit ones."""
    return 2 if "8bit" in optimizer else 8


def run_estimate(cfg, config, tokens, place, tile_tokens=0) -> dict:
    """estimate for a run's settings (a train.Config) in its dtype on its device. Offloaded checkpoints leave a CPU
    run's memory as it is: they are copied within it."""
    return estimate(
        config, tokens, place.dtype, cfg.quantize, cfg.adapters(cfg.lora_dropout), optimizer_bytes(cfg.optimizer),
        cfg.activation_checkpointing, chunked=cfg.chunked_loss,
        shards=place.world if cfg.parallel == "fsdp" else 0, offload=cfg.cpu_offload, tile_tokens=tile_tokens,
        offload_checkpoints=cfg.offload_checkpoints and place.device.type == "cuda",
        dropout_masks=place.device.type != "cuda",
    )  # fmt: skip


def fmt(n):
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / MIB:.1f} MiB"


def peak(device) -> int:
    """Peak bytes since reset_peak: torch's CUDA allocator peak, or on CPU the process's peak resident set
    (Linux's VmHWM; ru_maxrss elsewhere, which also counts what a parent held when it forked us)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    if os.path.exists("/proc/self/status"):
        return vm_hwm()
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def vm_hwm(pid="self") -> int:
    """A live Linux process's peak resident bytes since its exec or its last reset (0 once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:")), 0)
    except (FileNotFoundError, ProcessLookupError):  # a child that exited between a poll and this read
        return 0


def reset_peak(device):
    """Start the CUDA allocator's peak afresh, so that it measures the steps, not loading (on CPU: no-op)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
