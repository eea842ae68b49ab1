"""What this file proves about bench.py and benchmarks/ (nothing here is timed, no speed is asserted):

The training comparison (`bench.py train`):

- the peer (transformers + PEFT) trains on exactly the token tensors train.py trains on: for the equal-work file and
  for the stdlib dataset one example per row, cpu_train.peer_dataset(...).step_batch equals train.build_data(...)'s
  step_batch tensor for tensor, step after step and across the epoch boundary;
- every row of the equal-work file is a full 512-token row with all 511 targets supervised, so neither side pads;
- common.hf_batch turns our pre-shifted labels and per-document position ids into inputs on which transformers'
  LlamaForCausalLM computes our loss: its mean cross-entropy on a padded batch equals our Llama's summed loss over
  the supervised-token count (a small random model, fp32);
- with --repeat, the tables pool each configuration's repeats and give every ratio as the median of the per-round
  ratios (not the ratio of pooled rates), and results written before --repeat existed still print.

The GPU benchmark (`bench.py gpu`):

- `python bench.py gpu --shape=tiny` runs end to end on CPU and prints both tables with a row for every system and
  their ratios, the profile and the memory table, and writes the JSON; ours and the peer start from the same loss;
- median_ratio and workload_result pair each system's measured steps round by round (a system that stopped early
  is compared over the rounds both completed); a system whose step fails (out of memory) or that was skipped keeps
  its row with the reason, and the others run on;
- the natural workload holds the same documents on both sides: each exactly once in our packed rows and once in the
  peer's batches, with the same supervised tokens; every peer batch fits the token budget and is as long as it can be;
- the equal-work batches are full rows, every token supervised, identical for both systems; the peer built by
  build_systems holds our very weight tensors and computes our loss on them;
- the profile sorts kernels as an H200 names them: FlashAttention's (whose names hold "cutlass") as attention, cuBLAS's
  as matmuls, support/nf4_cuda.py's Triton kernel as NF4 dequantization, Inductor's fused kernels as other.
"""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import transformers

import train
from benchmarks import common, cpu_train, gpu, gpu_systems, gpu_workloads
from support import run_dir
from support.hf_config import from_hf, read_config
from support.tokenizer import Tokenizer
from train import load_model


@pytest.fixture(scope="module")
def setup(smollm2_dir, tmp_path_factory):
    """(tokenizer, cache dir, equal-work JSONL) shared by the tests: the stdlib dataset is tokenized once."""
    tmp = tmp_path_factory.mktemp("bench")
    tok, cache = Tokenizer(smollm2_dir), str(tmp / "cache")
    path = str(tmp / "padded.jsonl")
    cpu_train.write_padded_jsonl(path, tok, cache_dir=cache)
    return tok, cache, path, read_config(smollm2_dir)[0]


def train_batches(cfg, tok, steps):
    place = train.Placement(0, 1, torch.device("cpu"))
    trainset, _, _ = train.build_data(cfg, tok, run_dir.data_files(cfg), 8192, place)
    rows = cfg.batch_tokens // trainset.context_length
    return [trainset.step_batch(s, rows) for s in steps]


@pytest.mark.parametrize("workload", ["padded", "stdlib"])
def test_peer_sees_train_py_tensors(setup, workload):
    tok, cache, path, _ = setup
    data = path if workload == "padded" else ""
    cfg = train.Config(
        data=data,
        val_data=data,
        pack=False,
        train_on_prompt=bool(data),
        context_length=cpu_train.CONTEXT,
        batch_tokens=cpu_train.ROWS * cpu_train.CONTEXT,
        seed=cpu_train.SEED,
        cache_dir=cache,
    )
    ds = cpu_train.peer_dataset(data, tok, bool(data), cache_dir=cache)
    steps = [0, 1, 2, ds.steps_per_epoch(cpu_train.ROWS) + 1]  # the last one is in the second epoch
    for step, ours in zip(steps, train_batches(cfg, tok, steps), strict=True):
        peer = ds.step_batch(step, cpu_train.ROWS)
        assert peer.keys() == ours.keys()
        for k in ours:
            assert torch.equal(peer[k], ours[k]), (workload, step, k)
        if workload == "padded":
            assert peer["input_ids"].shape == (cpu_train.ROWS, cpu_train.CONTEXT)
            assert int((peer["labels"] != -100).sum()) == cpu_train.ROWS * (cpu_train.CONTEXT - 1)


def test_hf_batch_gives_our_loss(setup, tiny_dir):
    tok, cache, _, _ = setup
    model = load_model(tiny_dir)  # SmolLM2's vocabulary, RoPE and tied head, 2 small layers
    ref = transformers.LlamaForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()

    batch = cpu_train.peer_dataset("", tok, False, cache_dir=cache).step_batch(0, cpu_train.ROWS)
    inputs = common.hf_batch(batch)
    assert (inputs["attention_mask"] == 0).any(), "the batch should hold padding"
    with torch.no_grad():
        loss_sum, n = model(batch["input_ids"], batch["position_ids"], labels=batch["labels"])
        theirs = ref(**inputs).loss
    assert n == int((inputs["labels"] != -100).sum())
    torch.testing.assert_close(loss_sum / n, theirs, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- bench.py train --repeat


def train_results(rates, repeat_key=True):
    """Results of padded-fp32 (peer and ours) with one 1-second step per run at the given tokens/s, round by round."""
    runs = []
    for k, (peer, ours) in enumerate(rates):
        for system, rate in (("peer", peer), ("ours", ours)):
            run = dict(name=f"padded-fp32/{system}", system=system, precision="fp32", label=None, peak_rss=2**30)
            run |= dict(steps=[dict(time=1.0, tokens=rate, supervised=rate, flops=rate, loss=2.0)], first_batch="abc")
            runs.append(run | (dict(repeat=k) if repeat_key else {}))
    return dict(warmup=0, peaks={"fp32": 1e9, "bf16": 1e9}, runs=runs)


def test_train_tables_take_the_median_of_per_round_ratios(capsys):
    results = train_results([(100, 150), (50, 100), (100, 210)])  # per-round ratios 1.5, 2.0, 2.1
    by = cpu_train.merge_repeats(results)
    assert sorted(by["padded-fp32/ours"]["rounds"]) == [0, 1, 2]
    ratio = cpu_train.round_ratio(by["padded-fp32/ours"], by["padded-fp32/peer"], "tokens_per_s")
    assert ratio == dict(median=2.0, low=1.5, high=2.1, n=3)  # the pooled rates would give 460 / 250 = 1.84
    cpu_train.print_tables(results)
    out = capsys.readouterr().out
    assert "2.00x / 1.00x (1.50-2.10, 3 rounds)" in out
    cpu_train.print_tables(train_results([(100, 150)], repeat_key=False))  # a results.json from before --repeat
    assert "1.50x / 1.00x" in capsys.readouterr().out


# ----------------------------------------------------------------------------- bench.py gpu


RUN_PAIRS = [pair for pair in gpu_systems.PAIRS if "peer-liger" not in pair]  # the pairs of the systems CPU runs


def test_gpu_command_on_cpu(tmp_path):
    """`bench.py gpu --shape=tiny` on CPU: every system but Liger's (GPU only, skipped with its reason) trains, the
    compiled peer included; each table has every row and ratio; step 1's loss of our LoRA equals the peer's on the
    same weights and tensors; --memory, --contexts and --profile report."""
    out = tmp_path / "gpu.json"
    argv = [sys.executable, "bench.py", "gpu", "--shape=tiny", "--warmup=1", "--rounds=2", f"--out={out}"]
    env = dict(os.environ, OMP_NUM_THREADS="1")  # one thread: a shared 2-core machine is not oversubscribed
    proc = subprocess.run(
        [*argv, "--memory", "--contexts=128,256", "--profile"],
        cwd=common.REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    text = proc.stdout
    tables = text[text.index("\nequal work:") :]
    equal, natural = tables.split("\nnatural batching:")[:2]
    for table in (equal, natural):
        for key, label in gpu_systems.SYSTEMS.items():  # every system has its row, and it ran (Liger's: GPU only)
            row = next(line for line in table.splitlines() if line.startswith(label + "  "))
            if key == "peer-liger":
                assert "skipped: Liger's kernels are Triton kernels for a GPU" in row, row
            else:
                assert "failed" not in row and "skipped" not in row, row
        for a, b in RUN_PAIRS:
            assert f"{gpu_systems.SYSTEMS[a]} / {gpu_systems.SYSTEMS[b]}" in table
    assert "profile of one equal-work step, nanoqlora QLoRA (NF4)" in text and "peak memory of nanoqlora" in text
    results = json.loads(out.read_text())
    for name in ("equal", "natural"):
        work = results["workloads"][name]
        assert all("summary" in work["systems"][k] for k in gpu_systems.SYSTEMS if k != "peer-liger"), work
        assert {r["n"] for r in work["ratios"].values()} == {2} and len(work["ratios"]) == len(RUN_PAIRS)
    first = {k: v["steps"][0]["loss"] for k, v in results["workloads"]["equal"]["systems"].items() if "steps" in v}
    assert first["ours-lora"] == pytest.approx(first["peer-lora"], abs=2e-3)  # same weights, same tensors (bf16)
    assert len(results["memory"]) == 6 and set(results["profile"]) == {"ours-lora", "ours-qlora"}
    assert [r["row"] for r in results["contexts"]] == [128, 256] and results["longest"]["estimate_tokens"] > 256


def step_record(seconds, tokens):
    return dict(time=seconds, tokens=tokens, supervised=tokens, real=tokens, rows=1, width=tokens, flops=1.0, loss=1.0)


def test_median_ratio_pairs_rounds():
    assert common.median_ratio([(2.0, 1.0), (4.0, 1.0), (6.0, 3.0)]) == dict(median=2.0, low=2.0, high=4.0, n=3)
    assert common.median_ratio([]) is None
    model, opt = torch.nn.Linear(2, 2), SimpleNamespace(state={})  # what resident_bytes reads
    systems = [gpu_systems.System(k, model=model, params=[], opt=opt) for k in ("ours-lora", "peer-lora")]
    records = {  # step 0 is the warm-up; the peer stopped after two measured rounds
        "ours-lora": [step_record(9.0, 10), step_record(1.0, 10), step_record(1.0, 30), step_record(1.0, 10)],
        "peer-lora": [step_record(1.0, 10), step_record(1.0, 5), step_record(2.0, 10)],
    }
    result = gpu_workloads.workload_result(systems, records, {}, 1, 1.0, "tokens")
    assert result["ratios"] == {"ours-lora/peer-lora": dict(median=4.0, low=2.0, high=6.0, n=2, metric="tokens")}
    assert result["systems"]["ours-lora"]["summary"]["tokens_per_s"] == pytest.approx(50 / 3)


def test_natural_work_same_documents():
    row, rows = 256, 2
    ours, peer, batches = gpu_workloads.natural_work(512, row, rows, n_docs=300)
    lens = gpu_workloads.doc_lengths(300, row)
    assert np.array_equal(lens, gpu_workloads.doc_lengths(300, row)) and lens.min() >= 8 and lens.max() <= row  # seeded
    assert np.array_equal(peer.lens, lens) and np.array_equal(ours.lens, lens)
    assert sorted(d for r in ours.rows for d in r) == list(range(300))  # each document once, packed
    assert sorted(d for b in batches for d in b) == list(range(300))  # and once in the peer's batches
    for b, nxt in zip(batches, batches[1:] + [None], strict=True):
        assert len(b) * lens[b].max() <= rows * row
        if nxt is not None:  # as long as it can be: the next document would not fit
            assert (len(b) + 1) * max(lens[b].max(), lens[nxt[0]]) > rows * row
    sup = lambda batch: int((batch["labels"] != -100).sum())  # noqa: E731
    ours_sup = sum(sup(ours.collate([r])) for r in range(len(ours)))
    assert ours_sup == sum(sup(peer.collate(b)) for b in batches) == ours.num_supervised
    real = sum(int((ours.collate([r])["input_ids"] != 0).sum()) for r in range(len(ours)))
    assert real == lens.sum()  # pad id 0 never occurs in a document
    padded = sum(len(b) * lens[b].max() for b in batches)
    assert lens.sum() / (len(ours) * row) > 0.95 > lens.sum() / padded  # packing fills rows; padding does not


def test_equal_work_same_tensors_and_loss():
    cfg = from_hf(gpu_systems.SHAPES["tiny"][1])
    batches = gpu_workloads.equal_work(cfg.vocab_size, 64, 2, 3)
    for b in batches:
        assert b["input_ids"].shape == (2, 64) and int((b["labels"] != -100).sum()) == 2 * 63
        assert torch.equal(b["position_ids"], torch.arange(64).expand(2, 64))
        assert bool((common.hf_batch(b)["attention_mask"] == 1).all())
    assert not torch.equal(batches[0]["input_ids"], batches[1]["input_ids"])  # no document seen twice
    ours, peer = gpu_systems.build_systems(cfg, ["ours-lora", "peer-lora"], torch.device("cpu"), torch.float32)
    q = "model.layers.0.self_attn.q_proj"
    theirs = dict(peer.model.named_parameters())[f"base_model.model.{q}.base_layer.weight"]
    assert theirs.data_ptr() == ours.model.get_submodule(q).weight.data_ptr()  # the very same weights
    with torch.no_grad():  # adapters start at B = 0, so both compute the base model's loss
        torch.testing.assert_close(ours.forward(batches[0]), peer.forward(batches[0]), rtol=1e-5, atol=1e-5)


def test_kernel_kinds():
    names = {  # kernel names from a profile of a bf16 QLoRA step on an H200 (torch 2.11), cut short
        "void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128, 64, 128, 8, 2, "
        "4, 2, false, false, cutlass::bfloat16_t>>": "attention",
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bf16>>": (
            "attention"
        ),
        "nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT": "matmul",
        "aten::addmm": "matmul",
        "kernel": "NF4 dequantize",
        "triton_poi_fused__unsafe_view_add_mul_native_dropout_silu_10": "other",
    }
    assert {name: gpu.kernel_kind(name) for name in names} == names


def test_failing_system_gets_its_row_and_the_others_run(capsys):
    cfg = from_hf(gpu_systems.SHAPES["tiny"][1])
    batches = gpu_workloads.equal_work(cfg.vocab_size, 32, 1, 3)
    w = torch.nn.Parameter(torch.ones(()))
    opt = SimpleNamespace(state={}, step=lambda: None, zero_grad=lambda set_to_none: None)

    def out_of_memory(batch):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")

    systems = [
        gpu_systems.System(
            "ours-lora", lambda batch: w * batch["input_ids"].float().mean(), torch.nn.Linear(1, 1), [w], opt
        ),
        gpu_systems.System("peer-lora", out_of_memory, torch.nn.Linear(1, 1), [w], opt),
        gpu_systems.System("peer-qlora", status="skipped: bitsandbytes is not installed"),
    ]
    records, errors = gpu_workloads.run_workload(
        systems, lambda key, s: batches[s], 3, torch.device("cpu"), cfg, "equal"
    )
    assert len(records["ours-lora"]) == 3 and records["peer-lora"] == []
    assert errors == {"peer-lora": "failed: OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"}
    result = gpu_workloads.workload_result(systems, records, errors, 1, 1.0, "tokens")
    assert "summary" in result["systems"]["ours-lora"] and result["ratios"] == {}
    gpu.print_workload("equal", result, systems)
    rows = {line.split("  ")[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "failed: OutOfMemoryError" in rows["transformers + PEFT LoRA"]
    assert "skipped: bitsandbytes" in rows["transformers + PEFT + bitsandbytes QLoRA"]
    assert "100.0%" in rows["nanoqlora LoRA"]
