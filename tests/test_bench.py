"""What this file proves about bench.py and benchmarks/ (nothing here is timed, no speed is asserted):

The GPU benchmark (`bench.py gpu`):

- `python bench.py gpu-proof --shape=tiny`, the rehearsal of what a lent GPU runs, goes through its six phases on CPU
  within its budget (the CUDA tests, the step eager and compiled with every system's rows, ratios and profiles, two
  rl.py steps, the longest row, the ladder), each writing its JSON and its tables; ours and the peer start from the
  same loss; a phase the budget cannot fit is skipped, one past its limit is killed with its process group, and no
  round of steps starts after a deadline; `bench.py gpu --memory` reports our QLoRA's memory beside the estimate;
- median_ratio and workload_result pair each system's measured steps round by round (a system that stopped early
  is compared over the rounds both completed); a system whose step fails (out of memory) or that was skipped keeps
  its row with the reason, and the others run on;
- the natural workload holds the same documents on both sides: each exactly once in our packed rows and once in the
  peer's batches, with the same supervised tokens; every peer batch fits the token budget and is as long as it can be;
- the equal-work batches are full rows, every token supervised, identical for both systems; the peer built by
  build_systems holds our very weight tensors and computes our loss on them;
- common.hf_batch turns our pre-shifted labels and per-document position ids into inputs on which transformers'
  LlamaForCausalLM computes our loss: its mean cross-entropy on a padded batch of real examples equals our Llama's
  summed loss over the supervised-token count (a small random model, fp32); common.hf_packed_batch does the same for
  packed rows without padding (TRL's padding-free batching), documents kept apart by the position ids alone;
- `--shape=smollm2`, the CPU comparison, is the configuration of the SmolLM2-135M-Instruct the tests convert (bos and
  eos ids aside);
- the profile sorts kernels as an H200 names them: FlashAttention's (whose names hold "cutlass") as attention, cuBLAS's
  as matmuls, support/kernels/nf4_ops.py's Triton kernel as NF4 dequantization, Inductor's fused kernels as other.

`bench.py under-load`: a run's fair share is its threads' even split of the cores with the other busy threads (1.5x
for 2 threads on 2 cores beside one, 2x beside a copy of itself, 1x where the cores are enough); each slowdown is
the median of the rounds' loaded time over the same round's idle time, then over that fair share.
"""

import dataclasses
import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np
import psutil
import pytest
import torch
import transformers

import pack
from benchmarks import common, gpu, gpu_proof, gpu_systems, under_load
from support.data.examples import stdlib_examples
from support.data.tokenizer import Tokenizer
from support.evaluation import sandbox
from support.formats.hf import from_hf, read_config
from train import load_model


def test_hf_batch_gives_our_loss(tiny_dir):
    model = load_model(tiny_dir)  # SmolLM2's vocabulary, RoPE and tied head, 2 small layers
    ref = transformers.LlamaForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32).eval()

    examples = stdlib_examples("train")[:16]
    batch = pack.build_dataset(examples, Tokenizer(tiny_dir), 512, pack=False, seed=common.SEED).step_batch(0, 4)
    inputs = common.hf_batch(batch)
    assert (inputs["attention_mask"] == 0).any(), "the batch should hold padding"
    with torch.no_grad():
        loss_sum, n = model(batch["input_ids"], batch["position_ids"], labels=batch["labels"])
        theirs = ref(**inputs).loss
    assert n == int((inputs["labels"] != -100).sum())
    torch.testing.assert_close(loss_sum / n, theirs, rtol=1e-5, atol=1e-5)


def test_hf_packed_batch_gives_our_loss(tiny_dir):
    """The packed peer's inputs (TRL's padding-free batching): on rows that each pack several real examples, laid end
    to end in one row with no attention mask, transformers' sdpa Llama keeps documents apart from the position ids
    alone: our loss and our logits; the same row with the position ids dropped (one causal span) gives other logits,
    so the check can fail."""
    model = load_model(tiny_dir)
    ref = transformers.LlamaForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32, attn_implementation="sdpa")
    examples = stdlib_examples("train")[:24]
    batch = pack.build_dataset(examples, Tokenizer(tiny_dir), 512, pack=True, seed=common.SEED).step_batch(0, 2)
    inputs = common.hf_packed_batch(batch)
    assert (batch["position_ids"][:, 1:] == 0).sum() >= 4, "the rows should pack several documents"
    with torch.no_grad():
        loss_sum, n = model(batch["input_ids"], batch["position_ids"], labels=batch["labels"])
        logits = model(batch["input_ids"], batch["position_ids"])
        theirs = ref.eval()(**inputs, use_cache=False)  # as training runs it (peft_lora): a cache hides the packing
        unpacked = ref(input_ids=inputs["input_ids"], use_cache=False).logits
    assert n == int((inputs["labels"] != -100).sum())
    torch.testing.assert_close(loss_sum / n, theirs.loss, rtol=1e-5, atol=1e-5)
    near = (theirs.logits.view_as(logits) - logits).abs().max()
    assert near < 1e-4 and (unpacked.view_as(logits) - logits).abs().max() > 100 * near


def test_smollm2_shape_is_smollm2(smollm2_dir):
    theirs = dataclasses.replace(read_config(smollm2_dir)[0], bos_token_id=None, eos_token_id=None)
    assert from_hf(gpu_systems.SHAPES["smollm2"][1]) == theirs


# ----------------------------------------------------------------------------- bench.py gpu


def gpu_proof_rehearsal(tmp_path, budget):
    """Run `bench.py gpu-proof --shape=tiny` on CPU, compilation off (TORCH_COMPILE_DISABLE: the compiled systems run
    their eager code; test_model.py proves the compiled blocks), no wheels: (proof.json, {phase: its JSON}, proof.md,
    the seconds it took)."""
    out = tmp_path / "proof"
    argv = [sys.executable, "bench.py", "gpu-proof", "--shape=tiny", f"--budget={budget}", f"--out={out}"]
    env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_COMPILE_DISABLE="1")  # one thread: 2 cores, not oversubscribed
    start = time.time()
    proc = subprocess.run([*argv, "--wheels=none"], cwd=common.REPO, env=env, capture_output=True, text=True)
    took = time.time() - start
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "no wheels in none/: the peers that need bitsandbytes or liger-kernel are skipped" in proc.stdout
    proof = json.loads((out / "proof.json").read_text())
    phases = {p: json.loads((out / f"{p}.json").read_text()) for p in PHASES if (out / f"{p}.json").exists()}
    return proof, phases, (out / "proof.md").read_text(), took


PHASES = [p[0] for p in gpu_proof.PHASES]
PHASES_SHARES = [p[:2] for p in gpu_proof.PHASES]


def test_gpu_proof_rehearsal_on_cpu(tmp_path):
    """The rehearsal of the command a lent GPU runs: every phase runs on CPU within the budget, exits cleanly and writes
    its JSON, and proof.md holds each phase's tables. tests: the CUDA tests, each skipped here (the same list
    pytest reports as skipped for want of CUDA). step and compiled: every system has its rows on both workloads
    (Liger skipped with its reason) with their ratios, our LoRA's first loss is the peer's on the same weights
    and tensors, and on the same packed rows the packed peer's (which keeps documents apart by the position ids:
    test_hf_packed_batch_gives_our_loss), and ours are profiled. rl: rl.py ran its two steps on a random model
    with SmolLM2's tokenizer, sampling and rewarding in the sandbox (confined where this kernel can). context:
    each setting tried a row longer than one document, which fit. ladder: every rung measured, its gains over the
    rung before and the baseline."""
    proof, phases, text, took = gpu_proof_rehearsal(tmp_path, budget=420)
    assert [p["name"] for p in proof["phases"]] == PHASES and set(phases) == set(PHASES)
    assert all(p["status"] == "exit code 0" and p["seconds"] <= p["limit_s"] for p in proof["phases"]), proof
    assert took < 420 + 30
    cuda_tests = phases["tests"]["outcomes"]
    assert len(cuda_tests) >= 25 and set(cuda_tests.values()) == {"SKIPPED"}
    assert f"{len(cuda_tests)} skipped" in phases["tests"]["summary"]
    for phase, keys in (("step", gpu_systems.EAGER), ("compiled", gpu_systems.COMPILED)):
        for work in phases[phase]["workloads"].values():
            assert list(work["systems"]) == keys
            for key in keys:
                want = "skipped: Liger's kernels are Triton kernels for a GPU" if key == "peer-liger" else None
                assert work["systems"][key].get("status") == want, (phase, key, work["systems"][key].get("status"))
            ran = [(a, b) for a, b in gpu_systems.PAIRS if {a, b} <= set(keys) - {"peer-liger"}]
            assert sorted(work["ratios"]) == sorted(f"{a}/{b}" for a, b in ran)
        assert set(phases[phase]["profile"]) == {k for k in keys if k.startswith("ours")}
    first = {
        k: v["steps"][0]["loss"] for k, v in phases["step"]["workloads"]["equal"]["systems"].items() if "steps" in v
    }
    assert first["ours-lora"] == pytest.approx(first["peer-lora"], abs=2e-3)  # same weights, same tensors
    natural = phases["step"]["workloads"]["natural"]["systems"]
    assert natural["peer-packed"]["note"] == "attention sdpa, Liger off"
    first_packed = [natural[k]["steps"][0]["loss"] for k in ("ours-lora", "peer-packed")]
    assert first_packed[0] == pytest.approx(first_packed[1], abs=2e-3)  # the same packed rows
    for setting in phases["context"]["settings"]:
        long_rows = [a for a in setting["attempts"] if a["tokens"] > phases["context"]["doc"]]
        assert long_rows and all(a["status"] == "fits" for a in setting["attempts"]), setting
    rl = phases["rl"]
    assert rl["status"] == "exit code 0" and [r["step"] for r in rl["steps"]] == [1, 2], rl
    assert all(r["generated_per_s"] > 0 and 0 <= r["reward"] <= 1 for r in rl["steps"])
    assert "--max_steps=2" in rl["command"] and rl["confined"] == (sandbox.confinement() == "")
    ladder = phases["ladder"]
    assert all("summary" in ladder["systems"][f"rung{i}"] for i in range(len(ladder["rungs"])))
    assert all(g["previous"]["n"] >= 1 and g["baseline"]["n"] >= 1 for g in ladder["gains"].values())
    for phase in PHASES:
        assert f"## {phase}" in text and "(incomplete results" not in text


def test_a_phase_that_does_not_fit_the_budget_left_is_skipped():
    """phase_limit: a phase gets its share of the budget plus what earlier phases left, never more than is left, and
    none (with one line saying so) when that is under its minimum."""
    now = time.time()
    limit, line = gpu_proof.phase_limit("step", 0.3, 60, 500, now + 400, carried=20)
    assert limit == pytest.approx(170) and line == "step: up to 170 s"
    limit, _ = gpu_proof.phase_limit("step", 0.3, 60, 500, now + 100, carried=20)
    assert limit == pytest.approx(100, abs=1)
    limit, line = gpu_proof.phase_limit("ladder", 0.16, 30, 500, now + 25, carried=0)
    assert limit is None and line.startswith("ladder: skipped, 25 s of the budget left and it needs at least 30 s")


def test_the_phases_chosen_share_the_whole_budget():
    """chosen_phases: --phases=compiled,context gives those two the whole budget, in PHASES' proportions; a name that
    is not a phase ends the command with one line naming the option and the phases."""
    shares = dict(PHASES_SHARES)
    chosen = gpu_proof.chosen_phases("context,compiled")
    assert [name for name, _, _ in chosen] == ["compiled", "context"]
    total = shares["compiled"] + shares["context"]
    assert [share for _, share, _ in chosen] == pytest.approx([shares["compiled"] / total, shares["context"] / total])
    with pytest.raises(SystemExit, match="--phases=tests,step,warp: expected a comma-separated subset of tests,"):
        gpu_proof.chosen_phases("tests,step,warp")


def test_a_phase_past_its_limit_is_killed_with_its_process_group(tmp_path):
    """run_phase streams a child's lines as they come and, at the limit, kills its whole process group (a grandchild
    too): it returns None for the exit code and the lines printed before, promptly."""
    child = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
        "print(p.pid, flush=True); time.sleep(60)"
    )
    start = time.time()
    with open(tmp_path / "log.txt", "w") as log:
        code, lines = gpu_proof.run_phase([sys.executable, "-c", child], dict(os.environ), start + 3, log)
    assert code is None and time.time() - start < 15
    grandchild = int(lines[0])
    time.sleep(0.5)
    assert not psutil.pid_exists(grandchild) or psutil.Process(grandchild).status() == psutil.STATUS_ZOMBIE
    assert (tmp_path / "log.txt").read_text() == lines[0]


def test_no_round_starts_after_the_deadline():
    """run_workload with a deadline already past runs no step; workload_result reports each system as stopped."""
    cfg = from_hf(gpu_systems.SHAPES["tiny"][1])
    opt = SimpleNamespace(state={}, step=lambda: None, zero_grad=lambda set_to_none: None)
    system = gpu_systems.System("ours-lora", lambda b: 1 / 0, torch.nn.Linear(1, 1), [], opt)
    records, errors = gpu_systems.run_workload([system], None, 3, torch.device("cpu"), cfg, "equal", time.time() - 1)
    assert records == {"ours-lora": []} and errors == {}
    result = gpu_systems.workload_result([system], records, errors, 1, 1.0, "tokens")
    assert result["systems"]["ours-lora"]["status"].startswith("stopped: no measured step")


def test_gpu_memory_option_on_cpu(tmp_path):
    """`bench.py gpu --memory` on CPU: our QLoRA alone at 1, 2 and 4 rows, checkpointing off and on, each beside the
    estimate train.py prints (CPU has no allocator peak to measure)."""
    out = tmp_path / "gpu.json"
    argv = [sys.executable, "bench.py", "gpu", "--shape=tiny", "--systems=ours-qlora", "--warmup=1", "--rounds=1"]
    proc = subprocess.run([*argv, "--memory", f"--out={out}"], cwd=common.REPO, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    cells = json.loads(out.read_text())["memory"]
    assert [(c["rows"], c["checkpointing"]) for c in cells] == [(r, c) for c in (False, True) for r in (1, 2, 4)]
    assert all(c["estimate_bytes"] > 0 and c["tokens_per_s"] > 0 for c in cells)
    assert "peak memory of nanoqlora QLoRA (NF4)" in proc.stdout


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
    result = gpu_systems.workload_result(systems, records, {}, 1, 1.0, "tokens")
    assert result["ratios"] == {"ours-lora/peer-lora": dict(median=4.0, low=2.0, high=6.0, n=2, metric="tokens")}
    assert result["systems"]["ours-lora"]["summary"]["tokens_per_s"] == pytest.approx(50 / 3)


def test_natural_work_same_documents():
    row, rows = 256, 2
    ours, peer, batches = gpu_systems.natural_work(512, row, rows, n_docs=300)
    lens = gpu_systems.doc_lengths(300, row)
    assert np.array_equal(lens, gpu_systems.doc_lengths(300, row)) and lens.min() >= 8 and lens.max() <= row  # seeded
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
    batches = gpu_systems.equal_work(cfg.vocab_size, 64, 2, 3)
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
        "nf4_dequantize_kernel": "NF4 dequantize",
        "void kDequantizeBlockwise<__nv_bfloat16, 512, 64, 8, 2>(float*, unsigned char*, float*, __nv_bfloat1": (
            "NF4 dequantize"
        ),
        "keyed_dropout_kernel": "LoRA dropout",
        "triton_poi_fused__unsafe_view_add_mul_native_dropout_silu_10": "other",
    }
    assert {name: gpu.kernel_kind(name) for name in names} == names


def test_failing_system_gets_its_row_and_the_others_run(capsys):
    cfg = from_hf(gpu_systems.SHAPES["tiny"][1])
    batches = gpu_systems.equal_work(cfg.vocab_size, 32, 1, 3)
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
    records, errors = gpu_systems.run_workload(systems, lambda key, s: batches[s], 3, torch.device("cpu"), cfg, "equal")
    assert len(records["ours-lora"]) == 3 and records["peer-lora"] == []
    assert errors == {"peer-lora": "failed: OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"}
    result = gpu_systems.workload_result(systems, records, errors, 1, 1.0, "tokens")
    assert "summary" in result["systems"]["ours-lora"] and result["ratios"] == {}
    gpu.print_workload("equal", result)
    rows = {line.split("  ")[0]: line for line in capsys.readouterr().out.splitlines()}
    assert "failed: OutOfMemoryError" in rows["transformers + PEFT LoRA"]
    assert "skipped: bitsandbytes" in rows["transformers + PEFT + bitsandbytes QLoRA"]
    assert "100.0%" in rows["nanoqlora LoRA"]


def test_under_load_slowdowns_are_per_round_over_the_fair_share():
    """fair_share on 2 and 4 cores; slowdown_rows pairs each round with its own idle run (round 2 runs 2x slower
    than round 1 on both sides, so the slowdown stays 2x) and divides the median by the fair share."""
    assert [under_load.fair_share(c, 2, 2) for c in ("idle", "busy", "copy")] == [1.0, 1.5, 2.0]
    assert [under_load.fair_share(c, 1, 2) for c in ("idle", "busy", "copy")] == [1.0, 1.0, 1.0]
    assert [under_load.fair_share(c, 4, 4) for c in ("idle", "busy", "copy")] == [1.0, 1.25, 2.0]
    results = {"rl": {"idle": [{"wall": 10.0}, {"wall": 20.0}], "busy": [{"wall": 20.0}, {"wall": 40.0}]}}
    rows = under_load.slowdown_rows(results, "rl", torch_threads=2, cores=2)
    assert rows == [
        ["nothing (idle)", "1.00x", "15.0 s, 1.00x (1.00-1.00), 1.00x fair"],
        ["one busy single-threaded process", "1.50x", "30.0 s, 2.00x (2.00-2.00), 1.33x fair"],
    ]
