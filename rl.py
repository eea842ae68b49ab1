"""rl.py: reinforcement learning from execution. GRPO over LoRA, each answer rewarded by running its tests.

    python rl.py configs/grpo_stdlib.py             # SmolLM2-135M-Instruct QLoRA on the stdlib's doctested functions
    python rl.py configs/grpo_stdlib.py --resume    # continue step-exactly from out_dir/checkpoint.pt
    python rl.py --data=problems.jsonl --kl_coef=0.04 --loss_norm=sequence

train.py shows the model right answers. Here the model answers and is told how well it did, by a check no one can
argue with: whether its program passes the tests, run in the sandbox (support/evaluation/sandbox.py, confined by the
kernel: a reward the program could forge would teach forging). One step of GRPO (Group Relative Policy Optimization,
Shao et al. 2024, https://arxiv.org/abs/2402.03300):

1. Rollout. P problems (support/data/problems.py); for each a group of G answers o_1..o_G sampled from the current
   policy pi_theta at temperature T within the top_p nucleus, all P*G in one batch through the KV cache, each prompt
   read once and its keys and values copied to its G rows, the NF4 weights dequantized once per rollout on CPU
   (support/evaluation/sampling.py).
2. Rewards. r_i = 1 when answer i's program (prompt + completion + test) passes, else 0. No partial credit: a share of
   asserts read from the program's own output is something the program could print.
3. Advantages, within the group: A_i = (r_i - mean(r)) / (std(r) + 1e-4), std with Bessel's correction (as TRL);
   scale_rewards=False drops the division (Dr. GRPO, Liu et al. 2025, https://arxiv.org/abs/2503.20783). The group's
   mean is the baseline: no value network. A group whose answers all got the same reward has every A_i = 0 and
   teaches nothing (`no_signal`: the share of such groups).
4. Loss, on the sampled tokens. The log-probability of token t of answer i under the policy, lp = log softmax(z / T)
   at o_t, z the logits, is computed by the training forward (never taken from the sampler), with gradient. A group's
   answers follow one copy of their prompt in a packed row, each seeing the prompt and itself only (an attention
   mask): the prompt, often longer than an answer, is computed once for G answers.
       ratio = exp(lp - lp_old)                      lp_old: the policy that sampled (lp itself, detached, when a
                                                     batch makes one update; updates_per_batch > 1 makes it older)
       pg    = -min(ratio * A_i, clip(ratio, 1 - eps, 1 + eps) * A_i)
       kl    = exp(lp_ref - lp) - (lp_ref - lp) - 1    Schulman's k3 estimator of KL(pi_theta || pi_ref): >= 0, and
                                                     unbiased, http://joschu.net/blog/kl-approx.html; times ratio,
                                                     which makes its gradient the reverse KL's (DeepSeek-V3.2, TRL)
       loss  = sum_i,t w_i,t * (pg + kl_coef * kl)
   with loss_norm's weights: "token" (DAPO, https://arxiv.org/abs/2503.14476) 1 / (all answer tokens of the step);
   "sequence" (the original GRPO) 1 / (len_i * P * G), every answer weighing the same; "constant" (Dr. GRPO)
   1 / (P * G * sample_tokens). With one update per batch, ratio = 1 and the gradient is REINFORCE's with the group
   mean as baseline: -sum w A_i grad lp. These are TRL's GRPOTrainer losses "dapo", "grpo" and "dr_grpo"
   (tests/test_rl.py proves loss and gradients equal on the same inputs).
5. The reference policy for free. pi_ref is the model before training. With LoRA that is the base model, and the base
   model is this model with its adapters switched off (lora.adapters_off): lp_ref costs one forward without gradient,
   and no second copy of the model is held.

Everything else is train.py's, one line each: the Config (RLConfig adds GRPO's settings), the QLoRA model, AdamW and its
schedule, precision, checkpoints and --resume (the problems and the samples of step s are functions of (seed, s)),
trackers, eval_task (HumanEval pass@1 before and after) and the outputs. One process; the policy has no dropout.
Shapes: P problems, G answers each, N = P*G sequences of a prompt and an answer, n the step's answer tokens.
"""

import dataclasses
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import support.run.threads  # noqa: F401 (before torch: how idle threads wait, support/run/threads.py)

# isort: split
import torch
from tqdm import tqdm

import lora
import train
from support.data import problems as problem_sets
from support.data.tokenizer import Tokenizer
from support.evaluation import humaneval
from support.evaluation.sampling import dense_weights, generate_batch
from support.formats.hf import read_config
from support.kernels.choice import pick_precision
from support.run import config, progress, ranks, run_dir
from support.run.config import above, at_least, integer_at_least, setting, within


@dataclass
class RLConfig(train.Config):
    # --- GRPO. train.Config's fields mean what they mean there; data: a JSONL of problems ("" = the stdlib's doctested
    # functions), max_examples: at most that many problems, sample_tokens: an answer's most tokens, context_length: a
    # prompt's and its answer's, micro_batch_tokens: per forward ("auto": about one group)
    group_size: int = setting(8, integer_at_least(2), resume=True)  # G answers sampled per problem
    problems_per_step: int = setting(2, integer_at_least(1), resume=True)  # P problems per step
    temperature: float = setting(1.0, above(0), resume=True)  # sampling temperature T, also in the policy's lp
    top_p: float = setting(1.0, within(0, 1, "(]"), resume=True)  # nucleus of the sampling
    kl_coef: float = setting(0.0, at_least(0, " (0 = no reference forward)"))  # the KL penalty's weight
    loss_norm: str = setting("token", ("token", "sequence", "constant"))  # DAPO's, GRPO's or Dr. GRPO's weights
    scale_rewards: bool = setting(True)  # divide advantages by the group's std (False: Dr. GRPO)
    updates_per_batch: int = setting(1, integer_at_least(1))  # optimizer updates per rollout (> 1: the clip acts)
    clip_eps: float = setting(0.2, above(0))  # the ratio is clipped to [1 - eps, 1 + eps]


# train.py's settings that rl.py does not use: refused unless left at their defaults
TRAIN_ONLY = ("data_format", "val_data", "val_fraction", "train_on_prompt", "truncate", "skip_bad_rows", "pack",
              "pad_to_max", "batch_tokens", "lora_dropout", "compile", "mlp_tile_tokens", "chunked_loss", "eval_rows",
              "eval_samples", "preview", "plan", "parallel", "cpu_offload")  # fmt: skip


def step_problems(cfg: RLConfig, n: int, step: int) -> list[int]:
    """The P problems of step `step`: epochs of seeded permutations of the n, a function of (seed, step) alone."""
    order = lambda epoch: torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed + epoch))  # noqa: E731
    return [int(order(k // n)[k % n]) for k in range(step * cfg.problems_per_step, (step + 1) * cfg.problems_per_step)]


# ----------------------------------------------------------------------------- rollout and rewards
@torch.no_grad()
def rollout(cfg: RLConfig, run, step: int) -> dict:
    """G sampled answers to each of the step's problems, seeded by (seed, step), and their rewards from the sandbox."""
    chosen = [run.problems[i] for i in step_problems(cfg, len(run.problems), step) for _ in range(cfg.group_size)]
    tok, template, start = run.tok, cfg.template or None, time.perf_counter()
    chat, prompts = humaneval.is_chat(tok, template), [humaneval.prompt_ids(p, tok, template) for p in chosen]
    stop = [tok.eos_id] if isinstance(tok.eos_id, int) else list(tok.eos_id or [])
    done = lambda i, new: humaneval.finished(tok.decode(new), chat)  # noqa: E731  (its code block has closed)
    run.model.eval()
    with dense_weights(run.model) if run.place.device.type == "cpu" else nullcontext(), run.place.autocast():
        answers = generate_batch(run.model, prompts, cfg.sample_tokens, stop, done, stop[0] if stop else 0,
                                 cfg.temperature, cfg.top_p, seed=cfg.seed * 1_000_003 + step)  # fmt: skip
    run.model.train()
    generated, texts = time.perf_counter(), [tok.decode([t for t in a if t not in stop]) for a in answers]
    completions = [humaneval.completion(t, chat) for t in texts]
    verdicts = humaneval.score(chosen, completions, confine=not cfg.eval_task_unconfined)
    rewards = torch.tensor([v == "passed" for v in verdicts], dtype=torch.float32)
    shown = [dict(prompt=chosen[0]["prompt"], answer=texts[i], reward=float(rewards[i])) for i in range(cfg.group_size)]
    return dict(seqs=list(zip(prompts, answers, strict=True)), rewards=rewards, samples=shown,
                task_ids=[p["task_id"] for p in chosen[:: cfg.group_size]], generate_s=generated - start,
                reward_s=time.perf_counter() - generated)  # fmt: skip


def advantages(rewards, group_size: int, scale: bool = True):
    """rewards (N,) in groups of G -> advantages (N,): r - the group's mean, divided by its std + 1e-4 when scale."""
    r = rewards.view(-1, group_size)
    centred = r - r.mean(1, keepdim=True)
    return (centred / (r.std(1, keepdim=True) + 1e-4) if scale else centred).flatten()


# ----------------------------------------------------------------------------- the loss
def micro_batches(seqs, max_tokens):
    """The step's sequences (prompt ids, answer ids) packed in order into rows of at most max_tokens tokens (a longer
    one alone), answers to one prompt after a single copy of it (a group that does not fit goes on in the next row,
    its prompt again). For each row: ids and position_ids (1, L), an answer's positions going on from its prompt's;
    `mask` (1, L, L), each token seeing the earlier tokens of its prompt and its own answer; `where` (m,) the
    positions whose logits predict answer tokens and `targets` (m,) those tokens."""
    rows, used = [], 0
    for prompt, answer in seqs:
        same = bool(rows) and rows[-1][-1][0] == prompt  # the row's last piece answers this prompt
        if not rows or (used and used + len(answer) + (0 if same else len(prompt)) > max_tokens):
            rows, used, same = rows + [[]], 0, False
        if not same:
            rows[-1].append((prompt, []))
            used += len(prompt)
        rows[-1][-1][1].append(answer)
        used += len(answer)
    return [packed_row(row) for row in rows]


def group_tokens(seqs, cfg: RLConfig) -> int:
    """micro_batch_tokens "auto": the longest group's prompt and answers, about one group a forward (a row's mask
    (L, L) grows with the square of its length)."""
    groups = range(0, len(seqs), cfg.group_size)
    return max(len(seqs[g][0]) + sum(len(a) for _, a in seqs[g : g + cfg.group_size]) for g in groups)


def packed_row(row):
    """One row of micro_batches from its pieces [(prompt, [answers])]."""
    ids, pos, seg, sees, where = [], [], [], [], []  # seg: each token's piece; sees: the prompt piece it also sees
    for prompt, answers in row:
        p, first = len(prompt), len(seg)
        ids, pos, seg, sees = ids + prompt, pos + list(range(p)), seg + [first] * p, sees + [first] * p
        for a in filter(None, answers):  # (an empty answer has no token to predict)
            where += [first + p - 1, *range(len(ids), len(ids) + len(a) - 1)]  # the prompt's last token, then a's
            seg, sees = seg + [len(seg)] * len(a), sees + [first] * len(a)
            ids, pos = ids + a, pos + list(range(p, p + len(a)))
    seg, sees, at = torch.tensor(seg), torch.tensor(sees), torch.arange(len(ids))
    mask = (at[None] <= at[:, None]) & ((seg[None] == seg[:, None]) | (seg[None] == sees[:, None]))  # (L, L)
    return dict(ids=torch.tensor([ids]), position_ids=torch.tensor([pos]), mask=mask[None], where=torch.tensor(where),
                targets=torch.tensor([t for _, answers in row for a in answers for t in a]))  # fmt: skip


def token_logprobs(model, batch, temperature, place):
    """lp (m,): log softmax(logits / T) of each answer token of a micro-batch, from the training forward: the logits
    (m, vocab) at `where` in the packed row (1, L), in fp32; no other position's logits are made."""
    with place.autocast():
        ids, pos, where, mask = (batch[k].to(place.device) for k in ("ids", "position_ids", "where", "mask"))
        logits = model(ids, pos, only=where, mask=mask)
    logits = logits.float() / temperature
    return logits.log_softmax(-1).gather(-1, batch["targets"].to(place.device)[:, None])[:, 0]


def token_weights(lengths, loss_norm: str, sample_tokens: int):
    """w (n,): each answer token's weight in the loss, for answers of `lengths` (N,): the docstring's step 4."""
    n = torch.as_tensor(lengths)
    per_answer = {"token": 1 / n.sum().float(), "sequence": 1 / (n.float() * len(n)),
                  "constant": torch.tensor(1 / (len(n) * sample_tokens))}[loss_norm]  # fmt: skip
    return per_answer.expand(len(n)).repeat_interleave(n)


def grpo_loss(lp, lp_old, lp_ref, adv, w, cfg: RLConfig):
    """The clipped surrogate plus the KL penalty, weighted (the docstring's step 4); all (m,) over answer tokens,
    lp_ref None without the penalty. Returns (loss, the tokens' k3 KL or None)."""
    ratio = torch.exp(lp - lp_old)
    per_token = -torch.min(ratio * adv, ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps) * adv)
    kl = None if lp_ref is None else torch.exp(lp_ref - lp) - (lp_ref - lp) - 1
    if kl is not None and cfg.kl_coef:
        per_token = per_token + cfg.kl_coef * kl * ratio
    return (per_token * w).sum(), kl


# ----------------------------------------------------------------------------- the step
@dataclass
class Run:
    """What the loop works with: the model and its optimizer, the problems, where the records go."""

    model: torch.nn.Module
    opt: torch.optim.Optimizer
    scaler: torch.amp.GradScaler
    tok: Tokenizer
    place: ranks.Placement
    problems: list  # the training problems
    eval_problems: list  # eval_task's, [] without one
    tracker: object = None
    step: int = 0
    last_saved: int | None = None
    history: list = field(default_factory=list)
    samples: list = field(default_factory=list)  # the last step's first group: prompt, answer and reward of each


def prepared(cfg: RLConfig, run, roll: dict) -> list[tuple]:
    """The step's micro-batches, each with its answer tokens' advantages, weights, lp_old and lp_ref (or Nones),
    these two computed before any update: lp_old when a batch makes more than one update (else each update's own lp,
    detached), lp_ref with the adapters off when the KL is weighed."""
    lengths = [len(a) for _, a in roll["seqs"]]
    adv = advantages(roll["rewards"], cfg.group_size, cfg.scale_rewards).repeat_interleave(torch.tensor(lengths))
    w = token_weights(lengths, cfg.loss_norm, cfg.sample_tokens)
    limit = cfg.micro_batch_tokens if isinstance(cfg.micro_batch_tokens, int) else group_tokens(roll["seqs"], cfg)
    window = min(layer.self_attn.window or math.inf for layer in run.model.model.layers)  # a mask knows no window
    batches = micro_batches(roll["seqs"], min(limit, window))
    with torch.no_grad():
        lp = lambda: torch.cat([token_logprobs(run.model, b, cfg.temperature, run.place) for b in batches])  # noqa: E731
        old = lp() if cfg.updates_per_batch > 1 else None
        with lora.adapters_off(run.model):  # the reference policy: this model, computing as its base
            ref = lp() if cfg.kl_coef else None
    sizes = [len(b["targets"]) for b in batches]
    split = lambda x: [None] * len(batches) if x is None else x.to(run.place.device).split(sizes)  # noqa: E731
    return list(zip(batches, *map(split, (adv, w, old, ref)), strict=True))


def backward(cfg: RLConfig, run, parts) -> tuple[float, float | None]:
    """One update's forward and backward over the micro-batches, gradients summed: (the loss, its tokens' mean KL)."""
    loss, kls = torch.zeros((), dtype=torch.float64), []
    for b, a, w, old, ref in parts:
        lp = token_logprobs(run.model, b, cfg.temperature, run.place)
        part, kl = grpo_loss(lp, lp.detach() if old is None else old, ref, a, w, cfg)
        run.scaler.scale(part).backward()
        loss += part.detach().double().cpu()
        kls += [] if kl is None else [kl.detach()]
    return loss.item(), float(torch.cat(kls).mean()) if kls else None


def grpo_step(cfg: RLConfig, run, roll: dict) -> dict:
    """updates_per_batch updates on one rollout; the record of the first (its loss and KL), the last one's norm."""
    start, params = time.perf_counter(), [p for group in run.opt.param_groups for p in group["params"]]
    parts = prepared(cfg, run, roll)
    for update in range(cfg.updates_per_batch):
        loss, kl = backward(cfg, run, parts)
        run.scaler.unscale_(run.opt)
        norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip or math.inf))
        if update == 0:  # the step's record: the loss and KL of the policy that sampled
            record = {"loss": loss} | ({"kl": kl} if kl is not None else {})
        if not run_dir.finite(record | {"grad_norm": norm}, run.scaler):  # the update is never applied
            return record | {"grad_norm": norm}
        run.scaler.step(run.opt)
        run.scaler.update()
        run.opt.zero_grad(set_to_none=True)
    tokens, seconds = sum(len(p) + len(a) for p, a in roll["seqs"]) * cfg.updates_per_batch, time.perf_counter() - start
    return record | {"grad_norm": norm, "train_s": seconds, "train_tokens_per_s": tokens / seconds}


def rl_step(cfg: RLConfig, run) -> dict:
    """Step run.step: a rollout, its rewards, the updates; its record, also appended to run.history."""
    lr = train.learning_rate(cfg, run.step)
    for group in run.opt.param_groups:
        group["lr"] = lr
    roll = rollout(cfg, run, run.step)
    groups, lengths = roll["rewards"].view(-1, cfg.group_size), [len(a) for _, a in roll["seqs"]]
    record = {"step": run.step + 1, "lr": lr, "reward": float(roll["rewards"].mean()),
              "reward_std": float(roll["rewards"].std()), "no_signal": float((groups.std(1) == 0).float().mean()),
              "answer_tokens": sum(lengths) / len(lengths), "answer_tokens_max": max(lengths),
              "generate_s": roll["generate_s"], "reward_s": roll["reward_s"],
              "generated_per_s": sum(lengths) / roll["generate_s"], "problems": roll["task_ids"]}  # fmt: skip
    record |= grpo_step(cfg, run, roll)
    if not run_dir.finite(record, run.scaler):
        run_dir.stop_not_finite(cfg, run.history + [record], run.last_saved)
    run.step, run.samples = run.step + 1, roll["samples"]
    run.history.append(record)
    return record


def loop(cfg: RLConfig, run):
    """Steps from run.step to max_steps; after each, what is due: eval_task and a group's answers at evaluations, the
    tracker, a checkpoint. Ctrl-C stops after the step under way, with a checkpoint of exactly that step."""
    bar = tqdm(total=cfg.max_steps, initial=run.step, dynamic_ncols=True)
    with bar, run_dir.stop_requests() as asked, run_dir.abrupt_ends(cfg, run):
        while run.step < cfg.max_steps and not asked:
            record = rl_step(cfg, run)
            if cfg.eval_every and (run.step % cfg.eval_every == 0 or run.step == cfg.max_steps) and not asked:
                record["samples"] = run.samples  # one group's sampled answers, with their rewards
                record |= humaneval.task_record(cfg, run.model, run.tok, run.eval_problems, run.place.autocast,
                                                run.step)  # fmt: skip
            bar.set_postfix_str(f"reward {record['reward']:.2f} no-signal {record['no_signal']:.2f} loss "
                                f"{record['loss']:.4f} gen {record['generated_per_s']:.0f} tok/s")  # fmt: skip
            bar.update(1)
            if run.tracker:
                run.tracker.log(record)
            if cfg.save_every and run.step % cfg.save_every == 0:
                run.last_saved = run_dir.save(cfg, run.model, run.opt, run.scaler, run.step, run.history)
    if run.last_saved != run.step:
        run.last_saved = run_dir.save(cfg, run.model, run.opt, run.scaler, run.step, run.history)
    if run.step < cfg.max_steps:
        print(f"interrupted: checkpoint at step {run.step} written; continue with --resume --out_dir={cfg.out_dir}")
        raise SystemExit(130)


def rl(cfg: RLConfig) -> list[dict]:
    """Train as `cfg` says; returns the metrics history (step 0's record, then one per step)."""
    config.check_config(cfg)
    config.check_unused(cfg, TRAIN_ONLY, "rl.py")
    if os.environ.get("WORLD_SIZE", "1") != "1":
        raise ValueError("rl.py runs in one process: start it with python, not torchrun")
    eval_problems = humaneval.task_problems(cfg)  # a bad eval_task file fails here, before anything is written
    model_dir, _ = run_dir.claim_inputs(dataclasses.replace(cfg, preview=True))  # a preview claims no out_dir: not yet
    tok = Tokenizer(model_dir)
    found = problem_sets.training_problems(cfg, tok)  # a bad problem file fails here, with nothing written
    run_dir.claim_out_dir(cfg)
    print(f"{len(found)} problems; {cfg.problems_per_step} x {cfg.group_size} answers a step")
    place = ranks.setup(cfg)
    place.dtype = pick_precision(cfg.precision, place.device, read_config(model_dir)[0])
    model = train.build_model(dataclasses.replace(cfg, lora_dropout=0.0), place, model_dir, 0)  # no dropout: see top
    opt = train.make_optimizer(cfg, [p for p in model.parameters() if p.requires_grad], place.device)
    scaler = torch.amp.GradScaler("cuda", enabled=place.dtype == torch.float16)
    run = Run(model, opt, scaler, tok, place, found, eval_problems, progress.open_tracker(cfg))
    if cfg.resume:  # out_dir's checkpoint (adapters, optimizer, loss scale) and metrics
        run.step, run.history = run_dir.resume(cfg, model, opt, scaler)
        run.last_saved = run.step
    elif cfg.eval_every and (record := humaneval.task_record(cfg, model, tok, eval_problems, place.autocast, 0)):
        run.history.append({"step": 0} | record)  # the policy before training: eval_task's pass@1
        if run.tracker:
            run.tracker.log(run.history[-1])
    loop(cfg, run)
    adapter = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    run_dir.write_outputs(cfg, model, tok, [], run.history, adapter, model_dir, run.tracker)
    return run.history


def main(argv=None):
    """The command: a config file and --key=value flags; a user's mistake is one line."""
    ranks.one_line_errors(lambda: rl(config.load_config(RLConfig, sys.argv[1:] if argv is None else argv)))


if __name__ == "__main__":
    main()
