"""support/kernels/long_context.py: the tiled MLP and offloaded checkpoints, on CPU, in fp32.

What this file proves: a QLoRA step on two 4,096-token rows of two documents each, LoRA dropout live and keyed by
row, gives the loss and gradients of the plain checkpointed step with a tiled MLP, with offloaded checkpoints and with
both (and the tiled MLP without checkpointing gives those of the plain step): within fp32 rounding, 1e-6 of the loss
and 1e-5 of each gradient's largest entry (the tiles sum their gradients in another order); offloading copies each
saved tensor once (RoPE's cos and sin, which every block takes, once for all) and keeps no reference to the original,
so its memory is free once the forward has moved on.
"""

import dataclasses
import gc
import weakref

import pytest
import torch
from torch.utils.checkpoint import checkpoint

import lora
import quant
from model import Llama, LlamaConfig, Options
from support.kernels.dropout import dropout_rows, row_keys
from support.kernels.long_context import OffloadedSaves

CONFIG = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, max_position_embeddings=4096)  # fmt: skip
DOCS = [(2500, 1596), (1000, 3096)]  # two documents in each of two 4,096-token rows


def qlora_model(config=CONFIG, **options):
    """A tiny fp32 QLoRA Llama with LoRA (dropout 0.1) on every block linear, B away from zero, built with these
    options (model.Options): the same weights whatever the options."""
    torch.manual_seed(0)
    model = quant.quantize_(Llama(config, options=Options(**options)), compute_dtype=torch.float32)
    lora.add_lora_(model, "all-linear", r=4, alpha=8, dropout=0.1, lora_dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.1)
    return model.train()


def step(checkpointing, offload, tile):
    """(loss, LoRA gradients) of one forward and backward on the two rows, dropout keyed by row, by the model built
    with these options."""
    model = qlora_model(checkpointing=checkpointing, offload_checkpoints=offload, mlp_tile=tile)
    torch.manual_seed(1)
    ids = torch.randint(0, 128, (2, 4096))
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCS])
    with dropout_rows(model, row_keys(1337, 3, [0, 1])):
        loss, _ = model(ids, pos, labels=ids.roll(-1, 1))
        loss.backward()
    return loss.item(), [p.grad.clone() for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("offload, tile", [(False, 1000), (True, 0), (True, 1000)])
def test_checkpointed_steps_equal_the_plain_checkpointed_step(offload, tile):
    """With checkpointing: a tiled MLP (tiles of 1,000 tokens, the last one shorter), offloaded checkpoints, both."""
    want_loss, want = step(True, False, 0)
    loss, grads = step(True, offload, tile)
    assert loss == pytest.approx(want_loss, rel=1e-6)
    for got, ref in zip(grads, want, strict=True):
        assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_tiled_mlp_without_checkpointing_equals_the_plain_step():
    want_loss, want = step(False, False, 0)
    loss, grads = step(False, False, 512)
    assert loss == pytest.approx(want_loss, rel=1e-6)
    for got, ref in zip(grads, want, strict=True):
        assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()


def test_offloading_copies_each_saved_tensor_once_and_lets_the_original_go():
    """Two checkpointed calls under OffloadedSaves, each given its own input and a shared one: three copies, the first
    input freed as soon as the forward drops it, and the gradients those of the same calls without offloading."""
    weight = torch.randn(8, 8, requires_grad=True)
    shared = torch.randn(8)

    def block(x, s):
        return torch.tanh(x @ weight + s)

    def run(offloaded):
        x0 = torch.randn(4, 8, generator=torch.Generator().manual_seed(0), requires_grad=True)
        saves = OffloadedSaves(torch.device("cpu"))
        with saves if offloaded else torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            x1 = x0 * 2
            first = weakref.ref(x1)
            x2 = checkpoint(block, x1, shared, use_reentrant=False)
            del x1
            gc.collect()
            freed = first() is None
            out = checkpoint(block, x2, shared, use_reentrant=False)
        out.sum().backward()
        copies = len(saves.copies) if offloaded else None
        grad, weight.grad = weight.grad, None
        return grad, x0.grad, freed, copies

    grad, grad_x, freed, copies = run(offloaded=True)
    plain_grad, plain_grad_x, _, _ = run(offloaded=False)
    assert freed and copies == 3
    assert torch.equal(grad, plain_grad) and torch.equal(grad_x, plain_grad_x)


def test_a_gpu_run_keeps_what_is_in_cpu_memory_already():
    """With a side stream (a GPU run), a tensor saved from CPU memory (the documents' bounds every checkpointed block
    gets) is kept as it is: never copied, never put on a CUDA stream (the stand-in stream has no methods; touching it
    raises), and given back itself. The H200 run before this fix failed there ("Expected a cuda device, but got:
    cpu")."""
    saves = OffloadedSaves(torch.device("cpu"))
    saves.side = object()  # a GPU run's side stream, as far as pack can tell
    bounds = torch.tensor([0, 5, 9], dtype=torch.int32)
    packed = saves.pack(bounds)
    assert saves.unpack(packed) is bounds


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (pinned copies on a side stream)")
def test_on_a_gpu_offloading_frees_the_block_inputs_and_keeps_the_gradients():
    """On CUDA, in fp32 (TF32 off, as torch has it by default), 4 blocks: the offloaded and tiled step's loss and
    gradients are the checkpointed step's (within 1e-6 of the loss, 1e-5 of each gradient's largest entry: the tiles'
    matmuls are of other shapes and their gradients summed in another order), and its peak is lower by the block
    inputs it keeps off the GPU there: the peak is the last block's recomputation (its attention, in this tiny model),
    where the checkpointed step holds all 4 inputs and the offloaded one the recomputed block's only, so 3 inputs,
    within 10% for what else the two steps hold (the MLP's tiles)."""
    config = dataclasses.replace(CONFIG, num_hidden_layers=4)
    ids = torch.randint(0, 128, (2, 4096), device="cuda")
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCS]).cuda()

    def run(offload, tile):
        model = qlora_model(config, checkpointing=True, offload_checkpoints=offload, mlp_tile=tile).cuda()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        with dropout_rows(model, row_keys(1337, 3, [0, 1])):
            loss, _ = model(ids, pos, labels=ids.roll(-1, 1))
            torch.cuda.synchronize()
            held = torch.cuda.memory_allocated()
            loss.backward()
        torch.cuda.synchronize()
        grads = [p.grad.clone() for p in model.parameters() if p.requires_grad]
        return loss.item(), grads, held, torch.cuda.max_memory_allocated()

    want_loss, want, plain_held, plain_peak = run(False, 0)
    loss, grads, held, peak = run(True, 1000)
    print(f"\nbetween forward and backward {plain_held:,} -> {held:,} bytes; peak {plain_peak:,} -> {peak:,}")
    assert loss == pytest.approx(want_loss, rel=1e-6)
    for got, ref in zip(grads, want, strict=True):
        assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()
    one_input = 2 * 4096 * config.hidden_size * 4  # a block's fp32 input
    assert plain_peak - peak >= 0.9 * (config.num_hidden_layers - 1) * one_input, (plain_peak, peak, one_input)
