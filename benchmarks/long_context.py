"""How much memory does one long row take on the CPU, with checkpointing and with a tiled MLP, beside the estimate?

    python bench.py context                    one 16,384-token row of SmolLM2-135M QLoRA: checkpointing, then also a
                                               tiled MLP (a few minutes on 2 cores)
    python bench.py context --tokens=8192      another length

Each setting runs in a fresh process: the embedded SmolLM2-135M-Instruct built as train.py builds it with its defaults
(NF4 base, LoRA r=16 on every block linear, dropout 0.05; activation checkpointing on), in the precision train.py would
pick on this CPU, then one forward and backward pass of one row of `tokens` random tokens, one document (past the
model's 8,192 positions: RoPE extends, and the memory is what is measured). The peak resident set of that pass (VmHWM,
reset after loading) is printed beside support/accounting/memory.py's estimate for it, the process's own resident bytes
before the model was built added as train.py adds them ("process"); train.py's measured heap part is not, so the gap is
what glibc keeps beyond the live tensors. A second pair of processes has glibc map every block of 128 KiB or more on its
own (mmap threshold), so that a freed tensor leaves the resident set at once: their peak is the live tensors', what the
estimate describes. The tiled MLP takes tiles of hidden_size tokens, as mlp_tile_tokens="auto" does.
"""

import json
import subprocess
import sys
import time

import torch

from benchmarks.common import REPO, cpu_name, fmt_gb, print_table
from support.accounting import memory


def bench_long_context(tokens=16384):
    rows = []
    for live in (False, True):
        for tiled in (False, True):
            rows.append(measured_row(tokens, tiled, live))
    print(f"SmolLM2-135M QLoRA, one {tokens:,}-token row, forward + backward on {cpu_name()} "
          f"({torch.get_num_threads()} threads)")  # fmt: skip
    headers = ["setting", "heap", "precision", "peak RSS", "estimate", "peak / estimate", "step's growth", "s"]
    print_table(headers, rows)


def measured_row(tokens, tiled, live) -> list:
    """One setting's table row, measured in a process of its own."""
    args = [sys.executable, "-m", "benchmarks.long_context", str(tokens), str(int(tiled)), str(int(live))]
    out = subprocess.run(args, cwd=REPO, capture_output=True, text=True)
    if out.returncode:
        print(out.stdout + out.stderr)
        raise SystemExit(f"the {'tiled' if tiled else 'checkpointing'} run failed")
    r = json.loads(out.stdout.strip().splitlines()[-1])
    setting = "checkpointing" + (f" + MLP tiles of {r['tile']}" if tiled else "")
    heap = "blocks >= 128 KiB mapped" if live else "glibc's, as train.py"
    return [setting, heap, r["precision"], fmt_gb(r["peak"]), fmt_gb(r["estimate"]),
            f"{r['peak'] / r['estimate']:.2f}", fmt_gb(r["step_peak"]), f"{r['seconds']:.0f}"]  # fmt: skip


def measure(tokens, tiled, live) -> dict:
    """One forward and backward of one `tokens`-token row in this process (see the file docstring)."""
    import train
    from support.run.precision import pick_precision

    cfg = train.Config(activation_checkpointing=True, mlp_tile_tokens=0)
    model_dir, _ = train.claim_inputs(cfg)
    config = train.read_config(model_dir)[0]
    place = train.Placement(0, 1, torch.device("cpu"))
    place.dtype = pick_precision("auto", place.device, config)  # prints what it measured
    process = memory.process_rss()
    model = train.build_model(cfg, place, model_dir)
    model.mlp_tile = config.hidden_size if tiled else 0
    torch.manual_seed(0)
    batch = dict(input_ids=torch.randint(0, config.vocab_size, (1, tokens)), position_ids=torch.arange(tokens)[None])
    batch["labels"] = batch["input_ids"].roll(-1, 1)
    memory.steady_heap(128 * 2**10 if live else 32 * 2**20)  # live: every block of 128 KiB or more mapped on its own
    memory.reset_peak(place.device)
    before = memory.vm_hwm()
    start = time.perf_counter()
    loss, _ = train.forward_loss(model, batch, place)
    loss.backward()
    seconds = time.perf_counter() - start
    parts = memory.run_estimate(cfg, config, tokens, place, model.mlp_tile)
    peak = memory.peak(place.device)
    return dict(peak=peak, estimate=sum(parts.values()) + process, step_peak=peak - before, seconds=seconds,
                tile=model.mlp_tile, precision=str(place.dtype).removeprefix("torch."))  # fmt: skip


if __name__ == "__main__":  # a setting's own process: python -m benchmarks.long_context TOKENS TILED LIVE
    print(json.dumps(measure(int(sys.argv[1]), bool(int(sys.argv[2])), bool(int(sys.argv[3])))))
