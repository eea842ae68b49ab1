"""support/micro_batch.py: the micro-batch probe finds the largest size that fits under a simulated out-of-memory
allocator, frees each failed attempt before the next and resets the peak statistics. (On a GPU, test_train.py runs the
probe under a capped memory fraction.)
"""

import weakref

import pytest
import torch

from support import micro_batch


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
