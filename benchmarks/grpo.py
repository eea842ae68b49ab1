"""How fast is a GRPO step of rl.py against TRL's GRPOTrainer on CPU?

`python bench.py grpo` (--rounds=3 --steps=4: more of both). The same model, data and settings on both sides:
SmolLM2-135M-Instruct with an NF4 base (ours: quant.py, dequantized once per rollout for sampling; TRL: bitsandbytes NF4
with double quantization, fp32 compute, as PEFT's QLoRA), LoRA r=16, alpha=32 on every block linear, no dropout, AdamW
at configs/grpo_stdlib.py's learning rate, gradient clipping at 1.0; configs/grpo_stdlib.py's problems (the 24 stdlib
doctested functions with the shortest solutions, the prompts rendered by the same chat template), group size, problems
per step, temperature, answer length and KL coefficient, the token-level loss ("dapo" in TRL); each answer rewarded by
the same sandboxed run of its doctests. TRL generates with transformers' generate (no vLLM), in one batch of all the
step's answers; ours with generate_batch. One difference is kept as each system has it: ours stops an answer when its
code block closes (humaneval.finished), TRL at eos or max_completion_length; so the steps are compared by seconds and by
generated tokens per second of step.

Every run is a fresh child process: ours is `python rl.py configs/grpo_stdlib.py` with no evaluation or checkpoint,
its step times from metrics.jsonl (generation + rewards + the updates); TRL's is `python bench.py grpo-peer`, its step
times taken by a TrainerCallback between the step's begin and end. The first step of each run is left out (one-time
costs), the rounds alternate ours and TRL, and each ratio is the median of the per-round ratios of the medians. The
load average is printed with every run: the machine may be shared.
"""

import json
import os
import statistics
import tempfile
import time

import torch

from benchmarks.common import (
    OUT_DIR,
    REPO,
    SEED,
    machine,
    median_ratio,
    nf4_config,
    print_table,
    run_child_ok,
    run_records,
)

CONFIG = os.path.join(REPO, "configs", "grpo_stdlib.py")
SETTINGS = ["--sample_tokens=128"]  # shorter answers than the config's, so that a round takes minutes


def run_ours(steps, folder) -> dict:
    """One child run of rl.py: per-step seconds and generated tokens (the first step left out)."""
    out = os.path.join(folder, "ours")
    argv = ["rl.py", CONFIG, *SETTINGS, f"--max_steps={steps}", "--eval_task=", "--eval_every=0", "--save_every=0",
            f"--out_dir={out}", "--overwrite"]  # fmt: skip
    run_child_ok(argv, os.path.join(folder, "ours.log"), "rl.py")
    steps = [r for r in run_records(out) if "loss" in r][1:]
    seconds = [r["generate_s"] + r["reward_s"] + r["train_s"] for r in steps]
    generated = [r["generated_per_s"] * r["generate_s"] for r in steps]  # the step's answer tokens
    return dict(seconds=seconds, generated=generated, reward=[r["reward"] for r in steps])


def run_trl(steps, folder) -> dict:
    """One child run of TRL's GRPOTrainer (bench.py grpo-peer): the same per-step numbers."""
    out = os.path.join(folder, "trl.json")
    run_child_ok(["bench.py", "grpo-peer", f"--steps={steps}", f"--out={out}"], os.path.join(folder, "trl.log"), "TRL")
    steps_ = json.load(open(out))["steps"][1:]
    return {key: [s[key] for s in steps_] for key in ("seconds", "generated", "reward")}


def trl_peer(steps, out):
    """`steps` GRPO steps of TRL's GRPOTrainer with configs/grpo_stdlib.py's settings; per-step seconds, generated
    tokens and mean reward to the JSON file `out`."""
    import transformers
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    import rl
    from support.data import problems as problem_sets
    from support.data.tokenizer import Tokenizer, render
    from support.evaluation import humaneval
    from support.formats import atomic, gguf_read
    from support.run.config import load_config

    cfg = load_config(rl.RLConfig, [CONFIG, *SETTINGS])
    model_dir = gguf_read.smollm2_dir()
    tok = Tokenizer(model_dir)
    found, _ = problem_sets.training_problems(cfg, tok)
    by_id = {p["task_id"]: p for p in found}

    def prompt(p):
        return render({"instruction": humaneval.INSTRUCTION + p["prompt"].strip(), "response": ""}, tok, None)[0]

    data = Dataset.from_list([{"prompt": prompt(p), "task_id": p["task_id"]} for p in found])

    def reward(prompts, completions, task_id, **kwargs):  # the same sandboxed run of the same extracted code as ours
        verdicts = humaneval.score([by_id[t] for t in task_id], [humaneval.completion(c, True) for c in completions])
        return [float(v == "passed") for v in verdicts]

    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, quantization_config=nf4_config(torch.float32), device_map="cpu"
    )
    rows = cfg.problems_per_step * cfg.group_size
    args = GRPOConfig(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=rows, num_generations=cfg.group_size,
                      max_completion_length=cfg.sample_tokens, temperature=cfg.temperature, beta=cfg.kl_coef,
                      loss_type="dapo", learning_rate=cfg.lr, lr_scheduler_type="constant", warmup_steps=0,
                      max_grad_norm=cfg.grad_clip, max_steps=steps, logging_steps=1, save_strategy="no",
                      report_to="none", use_cpu=True, bf16=False, gradient_checkpointing=False, seed=SEED,
                      optim="adamw_torch")  # fmt: skip
    lora = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=0.0, target_modules="all-linear")
    timer = step_timer(rows)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data,
                          processing_class=transformers.AutoTokenizer.from_pretrained(model_dir), peft_config=lora,
                          callbacks=[timer])  # fmt: skip
    trainer.train()
    atomic.write_json(out, dict(steps=timer.steps))


def step_timer(rows):
    """A transformers TrainerCallback that times each optimizer step and keeps its logged mean completion length
    (times `rows` answers: the step's generated tokens) and mean reward."""
    import transformers

    class StepTimer(transformers.TrainerCallback):
        def __init__(self):
            self.steps, self.start = [], 0.0

        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.steps.append(dict(seconds=time.perf_counter() - self.start))

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "completions/mean_length" in logs and self.steps:
                self.steps[-1] |= dict(generated=logs["completions/mean_length"] * rows, reward=logs.get("reward"))
                print(f"step {len(self.steps)}: {self.steps[-1]}", flush=True)

    return StepTimer()


def bench_grpo(rounds, steps):
    """Rounds of ours then TRL, each `steps` steps; the table of medians and the ratios."""
    print(machine() | {"trl": __import__("trl").__version__})
    runs = {"ours": [], "trl": []}
    for r in range(rounds):
        for name, run in (("ours", run_ours), ("trl", run_trl)):
            folder = os.path.join(OUT_DIR, "grpo", f"{name}-{r}")
            os.makedirs(folder, exist_ok=True)
            load = os.getloadavg()[0]
            result = run(steps, folder) | dict(load_before=load, load_after=os.getloadavg()[0])
            runs[name].append(result)
            print(f"round {r + 1} {name}: {statistics.median(result['seconds']):.1f} s/step (median of "
                  f"{len(result['seconds'])}), load {load:.2f} -> {result['load_after']:.2f}", flush=True)  # fmt: skip
    json.dump(runs, open(os.path.join(OUT_DIR, "grpo", "results.json"), "w"))
    print_grpo_table(runs)


def print_grpo_table(runs):
    """Seconds per step and generated tokens per second of step, medians; ours / TRL as medians of per-round ratios."""
    per = lambda res: (statistics.median(res["seconds"]), sum(res["generated"]) / sum(res["seconds"]))  # noqa: E731
    rows = []
    for name in ("ours", "trl"):
        med = [per(res) for res in runs[name]]
        loads = ", ".join(f"{res['load_before']:.1f}" for res in runs[name])
        rows.append([name, f"{statistics.median(m[0] for m in med):.1f}", f"{statistics.median(m[1] for m in med):.1f}",
                     f"{statistics.mean(x for res in runs[name] for x in res['reward']):.3f}", loads])  # fmt: skip
    print_table(["system", "s / step", "generated tok/s", "mean reward", "load avg at start"], rows)
    pairs = list(zip((per(r) for r in runs["ours"]), (per(r) for r in runs["trl"]), strict=True))
    speed = median_ratio([(t[0], o[0]) for o, t in pairs])  # TRL's seconds over ours: > 1 means ours is faster
    rate = median_ratio([(o[1], t[1]) for o, t in pairs])
    span = lambda r: f"{r['median']:.2f}x ({r['low']:.2f}-{r['high']:.2f})"  # noqa: E731
    print(f"ours vs TRL: {span(speed)} per step, {span(rate)} generated tokens/s, {speed['n']} rounds")
