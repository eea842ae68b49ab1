"""support/kernels/dropout.py: LoRA's keyed dropout on CPU, on tiny shapes.

What this file proves: dropout drops p of each row and keeps the mean; its mask is SplitMix64's draws, a function of
(seed, step, row) and the element's place only, each adapted linear drawing its own; rows split into micro-batches,
with activation checkpointing or without, give the same loss and gradients (what lets a run resume on another number
of ranks); the module is chosen when the layer is built (none at p = 0) and is the identity in eval mode; a tiled
MLP's tiles of the rows drop exactly what the whole rows drop; compiled, the masks are eager's bits under every
vectorization Inductor can pick on the machine, its scalar code included.
"""

import pytest
import torch
from conftest import TINY
from torch._inductor import config as inductor_config
from torch._inductor import cpu_vec_isa
from torch._inductor.utils import run_and_get_code

import lora
from model import Llama, LlamaConfig, Options
from support.kernels.dropout import GOLDEN, KEYED_OP, KeyedDropout, dropout_rows, keyed_dropout, row_keys, tile_of_rows

IDS = torch.tensor([[1, 5, 9, 17, 33, 2, 60, 7, 100, 3], [4, 4, 8, 15, 16, 23, 42, 0, 99, 1]])
CONFIG = LlamaConfig(vocab_size=128, head_dim=16, max_position_embeddings=64, **TINY)


def vector_widths():
    """The widths of the vector code Inductor's C++ can be told to write here (cpp.simdlen: 512 for AVX-512, 256 for
    AVX2 on x86, where the CPU has them) and 0, its scalar code."""
    return [0] + sorted({isa.bit_width() for isa in cpu_vec_isa.valid_vec_isa_list()})


def adapted_llama(r, dropout, seed=0, checkpointing=False, op=None):
    """A tiny random fp32 Llama with LoRA on every block linear, its dropout applied by `op` (default keyed_dropout)."""
    torch.manual_seed(seed)
    model = Llama(CONFIG, options=Options(checkpointing=checkpointing))
    lora.add_lora_(model, "all-linear", r=r, alpha=2 * r, dropout=dropout, dropout_op=op)
    return model


def test_keyed_dropout_drops_p_and_keeps_the_mean():
    """Each row drops p of its features (within 0.003 over 250,000), the kept ones scaled by 1 / (1 - p)."""
    x = torch.ones(4, 250_000, dtype=torch.bfloat16)
    for p in (0.05, 0.1, 0.5):
        y = keyed_dropout(x, p, row_keys(1337, 3, range(4))).float()
        dropped = (y == 0).float().mean(1)
        assert (dropped - p).abs().max() < 0.003, (p, dropped)
        assert set(y.unique().tolist()) == {0.0, torch.tensor(1 / (1 - p), dtype=torch.bfloat16).item()}
        assert abs(y.mean().item() - 1) < 0.01


def splitmix64_draw(key, element):
    """The reference: element e of a row keyed `key` draws the (e % 4)-th 16 bits, lowest first, of SplitMix64's
    finalizer of key + (e // 4) * 0x9E3779B97F4A7C15, computed on Python's integers modulo 2**64."""
    z = (key + element // 4 * 0x9E3779B97F4A7C15) % 2**64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % 2**64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % 2**64
    z ^= z >> 31
    return (z >> 16 * (element % 4)) & 0xFFFF


def test_the_mask_is_splitmix64s_draws():
    """keyed_dropout keeps exactly the elements whose 16-bit draw from SplitMix64's finalizer (on Python's integers)
    reaches round(p * 65536), for rows of 22 elements (not a multiple of 4), negative keys and a tile from element 8,
    at p = 0.3 and at a p whose threshold has the draw's top bit set (0.7)."""
    x = torch.ones(3, 2, 11)
    keys = torch.tensor([1, -2, 3**39])
    for p, first in ((0.3, 0), (0.7, 0), (0.3, 8)):
        kept = keyed_dropout(x, p, keys, first) != 0
        threshold = round(p * 65536)
        expected = [[splitmix64_draw(k % 2**64, first + e) >= threshold for e in range(22)] for k in keys.tolist()]
        assert torch.equal(kept.flatten(1), torch.tensor(expected)), (p, first)


def test_dropout_is_a_function_of_seed_step_and_row():
    """A row's mask depends on (seed, step, its row in the global batch) and the element's place only: the same rows
    give the same masks as one batch or split (as ranks and micro-batches split them); another seed, step or row, and
    another module, give masks that agree only as independent draws do (1 - 2p(1 - p) of the elements). The keys are
    set only within dropout_rows."""
    x, p = torch.ones(6, 8, 100), 0.25

    def mask(seed, step, rows):
        return keyed_dropout(x[: len(rows)], p, row_keys(seed, step, rows)) != 0

    whole = mask(1, 2, range(6))
    assert torch.equal(whole, torch.cat([mask(1, 2, range(i, min(i + 4, 6))) for i in (0, 4)]))
    assert torch.equal(whole[3:5], mask(1, 2, [3, 4]))
    independent = 1 - 2 * p * (1 - p)
    for other in (mask(2, 2, range(6)), mask(1, 3, range(6)), mask(1, 2, range(1, 7))):
        assert abs((other == whole).float().mean().item() - independent) < 0.02
    model = adapted_llama(r=2, dropout=p)
    dropouts = [m.lora_dropout for m in lora.lora_modules(model).values()]
    with dropout_rows(model, row_keys(1, 2, range(6))):
        first, second = [keyed_dropout(x, p, d.keys) != 0 for d in dropouts[:2]]
    assert abs((first == second).float().mean().item() - independent) < 0.02
    assert all(d.keys is None for d in dropouts)


def test_the_dropout_module_is_chosen_when_the_layer_is_built():
    """p > 0 gives every adapted linear a KeyedDropout holding p (where PEFT's config reads it), the identity in eval
    mode; p = 0 gives nn.Identity, so nothing is drawn; a probability outside [0, 1] is refused in one line."""
    model = adapted_llama(r=2, dropout=0.1)
    dropouts = [m.lora_dropout for m in lora.lora_modules(model).values()]
    assert len(dropouts) == 14 and all(isinstance(d, KeyedDropout) and d.p == 0.1 for d in dropouts)
    x = torch.ones(3, 5, 64)
    assert (dropouts[0].train()(x) == 0).any()
    assert dropouts[0].eval()(x) is x
    model = adapted_llama(r=2, dropout=0.0)
    assert all(isinstance(m.lora_dropout, torch.nn.Identity) for m in lora.lora_modules(model).values())
    with pytest.raises(ValueError, match="between 0 and 1, but got 1.5"):
        KeyedDropout(1.5)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_live_dropout_gives_the_same_gradients_however_the_rows_are_split(checkpointing):
    """With dropout 0.5 live, the summed loss of 2 rows and its LoRA gradients are the same as one micro-batch of both
    rows and as two of one row each, keyed by their rows, with activation checkpointing (which recomputes the forward
    in the backward, so the masks must come out the same again) and without: within fp32 rounding (1e-5 of each
    gradient's largest entry; a mask drawn differently moves them by tens of percent)."""
    model = adapted_llama(r=4, dropout=0.5, checkpointing=checkpointing).train()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.3)
    labels = IDS.roll(-1, 1)
    results = []
    for split in ([[0, 1]], [[0], [1]]):
        model.zero_grad()
        total = 0.0
        for rows in split:
            with dropout_rows(model, row_keys(7, 0, rows)):
                loss, _ = model(IDS[rows], labels=labels[rows])
                loss.backward()
            total += loss.item()
        results.append([total] + [p.grad.clone() for p in model.parameters() if p.requires_grad])
    assert results[0][0] == pytest.approx(results[1][0], rel=1e-6)
    for a, b in zip(results[0][1:], results[1][1:], strict=True):  # sums in another order
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()
    model.zero_grad()
    with torch.no_grad():  # and the masks are live: another step's keys give another loss
        with dropout_rows(model, row_keys(7, 1, [0, 1])):
            assert model(IDS, labels=labels)[0].item() != pytest.approx(results[1][0], rel=1e-4)


def test_tiles_of_the_rows_drop_what_the_whole_rows_drop():
    """Keyed by dropout_rows, a KeyedDropout applied to tiles of its rows (tile_of_rows: 12, 8 and 20 tokens, features
    6 a token) gives, tile by tile, the bits of the whole rows' dropout; a tile whose first element is not a multiple
    of 4 of its row is refused in one line (its hashes would not line up)."""
    model = adapted_llama(r=2, dropout=0.3)
    dropout = next(m for m in model.modules() if isinstance(m, KeyedDropout)).train()
    x = torch.randn(2, 40, 6)
    with dropout_rows(model, row_keys(3, 5, [0, 1])):
        whole = dropout(x)
        tiles = []
        for first, tile in ((0, x[:, :12]), (12, x[:, 12:20]), (20, x[:, 20:])):
            with tile_of_rows(model, first):
                tiles.append(dropout(tile))
        assert torch.equal(torch.cat(tiles, dim=1), whole) and (whole == 0).any()
        with tile_of_rows(model, 3), pytest.raises(ValueError, match="starting at element 18 of its rows, not a"):
            dropout(x[:, 3:])
    assert dropout.first_token == 0


@pytest.mark.parametrize("keyed", [True, False])
def test_a_compiled_lora_linear_has_no_graph_break_at_the_dropout(keyed):
    """torch._dynamo.explain of an adapted linear's training forward, dropout live, with the row keys dropout_rows
    sets (keyed) and with keys drawn in the graph: one graph, no break, the dropout in it as the opaque KEYED_OP (its
    backward, the op again, is AOT autograd's to trace: tests/test_model.py compiles whole steps)."""
    model = adapted_llama(r=2, dropout=0.1, op=KEYED_OP)
    layer = model.model.layers[0].mlp.down_proj
    x = torch.randn(2, 5, layer.in_features, requires_grad=True)
    torch._dynamo.reset()
    with dropout_rows(model, row_keys(0, 1, [0, 1]) if keyed else None):
        explained = torch._dynamo.explain(lambda x: layer(x).sum())(x)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons
    assert "torch.ops.nanoqlora.keyed_dropout.default" in explained.graphs[0].code


@pytest.mark.parametrize("width", vector_widths())
def test_compiled_masks_are_eager_bits_under_every_vectorization(width):
    """With Inductor's C++ forced to each vector width this CPU runs (cpp.simdlen) and to scalar code: a KeyedDropout
    (p = 0.25) through KEYED_OP, compiled with dynamic shapes between a doubling and a weighted sum, gives the plain
    keyed_dropout's eager output and input gradient bit for bit (every weight nonzero, so a zero gradient is a dropped
    element), on 1 to 3 rows of 5 to 37 tokens of 12 or 20 features, as whole rows and as tiles starting at token 8;
    no hash constant reaches Inductor's generated code. The hash compiled as tensor code failed this: Inductor's C++
    multiplies the loop's index by a 64-bit constant, an overflow the C++ compiler may assume away
    (docs/internals.md)."""
    eager_dropout, compiled_dropout = KeyedDropout(0.25), KeyedDropout(0.25, KEYED_OP)

    def step(x, dropout):
        y = dropout(x * 2)
        (y * (torch.arange(y.shape[-1]) + 1)).sum().backward()
        return y

    torch._dynamo.reset()
    compiled = torch.compile(step, dynamic=True)
    with inductor_config.patch({"cpp.simdlen": width}):
        for rows, tokens, features, first in ((1, 16, 12, 0), (2, 37, 20, 0), (3, 5, 12, 8), (1, 30, 20, 8)):
            x = torch.randn(rows, tokens, features)
            outs = []
            for run, dropout in ((step, eager_dropout), (compiled, compiled_dropout)):
                dropout.keys, dropout.first_token = row_keys(4, 2, range(rows)), first
                xr = x.clone().requires_grad_()
                if run is compiled and first == 0 and rows == 1:  # the first compilation: its code is kept
                    out, code = run_and_get_code(run, xr, dropout)
                    assert code and not any(str(-GOLDEN) in c or str(GOLDEN) in c for c in code)
                else:
                    out = run(xr, dropout)
                outs.append((out.detach(), xr.grad))
            (eager, eager_grad), (out, grad) = outs
            assert (eager == 0).any() and (eager != 0).any() and torch.equal(grad == 0, eager == 0)
            assert torch.equal(out, eager) and torch.equal(grad, eager_grad), (rows, tokens, features, first)


def test_the_op_passes_torch_library_opcheck():
    """torch.library.opcheck of KEYED_OP, whole rows and a tile from element 48: its schema, its fake (the shapes
    torch.compile traces with), its autograd registration and its dynamic-shape tracing agree with what it does."""
    x = torch.randn(2, 9, 12, requires_grad=True)
    keys = row_keys(1, 2, range(2))
    for args in ((x, 0.25, keys), (x[:, 4:], 0.25, keys, 48)):
        torch.library.opcheck(KEYED_OP, args)
