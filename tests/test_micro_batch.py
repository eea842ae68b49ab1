"""support/accounting/micro_batch.py: the micro-batch probe finds the largest size that fits under a simulated
out-of-memory allocator, frees each failed attempt before the next and resets the peak statistics (on a GPU,
test_train.py runs the probe under a capped memory fraction); the MLP is tiled where one row of the context does not
fit untiled, and only there.
"""

import weakref

import pytest
import torch

from support.accounting import micro_batch


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

    assert micro_batch.probe_micro_rows(attempt, max_rows, torch.device("cuda")) == fit_up_to
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
    place = train.Placement(0, 1, torch.device("cpu"))
    asked = []
    monkeypatch.setattr(micro_batch, "fits_in_memory", lambda parts, place: asked.append(parts) or False)
    assert micro_batch.mlp_tile_tokens(train.Config(mlp_tile_tokens=96), place, config, 4096) == 96
    auto = train.Config()
    assert micro_batch.mlp_tile_tokens(auto, place, config, 64) == 0 and not asked  # one tile holds the row
    assert micro_batch.mlp_tile_tokens(auto, place, config, 4096) == 64 and len(asked) == 1
    monkeypatch.setattr(micro_batch, "fits_in_memory", lambda parts, place: True)
    assert micro_batch.mlp_tile_tokens(auto, place, config, 4096) == 0
