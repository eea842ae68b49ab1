"""rl.py: reinforcement learning from execution: GRPO over LoRA, rewarded by running tests.

    python rl.py configs/grpo_easy.py             # small functions: it learns, on 2 CPU cores
    python rl.py configs/grpo_stdlib.py --resume  # the stdlib's doctests, on from a checkpoint
    python rl.py --data=problems.jsonl --kl_coef=0.04 --loss_norm=sequence

train.py shows the model right answers. Here the model answers and is told how well it did, by a
check no one can argue with: whether its code passes the tests, judged in another process than the
one it runs in (support/evaluation/sandbox.py: a reward it could forge would teach forging). One step of
GRPO (Shao et al. 2024, https://arxiv.org/abs/2402.03300), P problems, G answers each, N = P*G
sequences, n answer tokens:

1. Rollout. G answers o_1..o_G to each problem, sampled at temperature T within the top_p nucleus, all N in
   one batch through the KV cache (support/evaluation/sampling.py).
2. Rewards. r_i = 1 when answer i's program passes its tests, else 0.
3. Advantages, within the group, whose mean is the baseline (no value network):
       A_i = (r_i - mean(r)) / (std(r) + 1e-4)
   std with Bessel's correction, as TRL; scale_rewards=False drops the division (Dr. GRPO,
   https://arxiv.org/abs/2503.20783). A group whose answers all got one reward has every A_i = 0 and
   teaches nothing (`no_signal`: the share of such groups): learnable_only keeps the problems the
   base model sometimes passes, skip_no_signal leaves such groups out (DAPO's dynamic sampling).
4. Loss, on the sampled tokens. lp = log softmax(z / T) at o_t, from the training forward with gradient;
   lp_old: the policy that sampled (lp detached, with one update a batch).
       ratio = exp(lp - lp_old)
       pg    = -min(ratio * A_i, clip(ratio, 1 - eps, 1 + eps) * A_i)
       kl    = exp(lp_ref - lp) - (lp_ref - lp) - 1        Schulman's k3, >= 0
       loss  = sum over i, t of w_i,t * (pg + kl_coef * kl * ratio)
   loss_norm's weights w: "token" (DAPO) 1 / n; "sequence" (GRPO) 1 / (len_i * N); "constant" (Dr. GRPO)
   1 / (N * sample_tokens): TRL's "dapo", "grpo" and "dr_grpo" (tests/test_rl.py proves loss and gradients
   equal). With one update a batch, ratio = 1: the gradient is REINFORCE's with the group's mean as baseline.
5. The reference policy for free. pi_ref is the model before training: with LoRA, this model with its
   adapters off (lora.adapters_off). lp_ref costs one forward without gradient.

A group's answers follow one copy of their prompt in a packed row, each token seeing the prompt and
its own answer (a mask): the prompt is computed once for G answers. Prompt p, answers a, b:

    token      p0  p1  p2  a0  a1  b0
    position    0   1   2   3   4   3      an answer goes on from its prompt
    sees       p0  p0  p0  p   p   p       p: all of p0 p1 p2
                   p1  p1  a0  a0  b0
                       p2      a1
    predicts    -   -  a0  a1  -   -       and p2's logits predict b0 too

Everything else is train.py's: train.Common's settings, the QLoRA model (no dropout: sampling and the loss
see one policy), AdamW and its schedule, the run around the loop (support/run/lifecycle.py).
"""

import dataclasses
import math
import sys
import time
from dataclasses import dataclass
from typing import NamedTuple

import support.run.threads  # noqa: F401 (first: how idle threads wait)

# isort: split
import torch

import lora
import train
from model import Options
from support.data import problems as problem_sets
from support.data.tokenizer import Tokenizer
from support.evaluation import humaneval
from support.run import answer_log, config, lifecycle, progress, ranks, run_dir, stopping
from support.run.config import above, at_least, integer_at_least, setting, within

LOSS_NORMS = ("token", "sequence", "constant")  # DAPO's, GRPO's, Dr. GRPO's


@dataclass
class RLConfig(train.Common):
    """GRPO's settings. Of train.Common's, data is a JSONL of problems ("" = the stdlib's, "easy" =
    small functions from templates) and context_length holds a prompt and its answer (docs/rl.md)."""

    group_size: int = setting(8, integer_at_least(2), resume=True)  # G answers a problem
    problems_per_step: int = setting(2, integer_at_least(1), resume=True)  # P
    temperature: float = setting(1.0, above(0), resume=True)  # T, also in lp
    top_p: float = setting(1.0, within(0, 1, "(]"), resume=True)  # sampling nucleus
    kl_coef: float = setting(0.0, at_least(0, " (0 = no reference forward)"))
    loss_norm: str = setting("token", LOSS_NORMS)  # the weights w of step 4
    scale_rewards: bool = setting(True)  # advantages / the group's std
    updates_per_batch: int = setting(1, integer_at_least(1))  # > 1: the clip acts
    clip_eps: float = setting(0.2, above(0))  # ratio clipped to [1 - eps, 1 + eps]
    learnable_only: bool = setting(False, resume=True)  # problems the base sometimes passes
    skip_no_signal: bool = setting(False)  # groups of one reward dropped (dynamic sampling)
    shuffle_rewards: bool = setting(False, resume=True)  # a control: blind rewards


# ----------------------------------------------------------------------------- rollout and rewards
@torch.no_grad()
def rollout(cfg: RLConfig, run, problems, step: int) -> dict:
    """G answers to each of the step's problems, sampled in one batch, judged in the sandbox."""
    G = cfg.group_size
    picked = problem_sets.step_problems(cfg.seed, cfg.problems_per_step, len(problems), step)  # seeded
    chosen = [problems[i] for i in picked for _ in range(G)]
    template = cfg.template or None
    start = time.perf_counter()
    with run.place.autocast():
        args = (template, cfg.sample_tokens, len(chosen), (cfg.temperature, cfg.top_p), cfg.seed * 1_000_003 + step)
        answers = humaneval.generate_answers(run.model, run.tok, chosen, *args)
    generated = time.perf_counter()
    texts = [humaneval.text(run.tok, a) for a in answers]
    completions = [humaneval.completion(t, humaneval.is_chat(run.tok, template)) for t in texts]
    verdicts = humaneval.score(chosen, completions, confine=not cfg.eval_task_unconfined)
    rewards = torch.tensor([v == "passed" for v in verdicts], dtype=torch.float32)
    lines = answer_log.lines(step + 1, chosen, texts, completions, verdicts, rewards.tolist())
    prompts = [humaneval.prompt_ids(p, run.tok, template) for p in chosen]
    shown = [dict(prompt=chosen[0]["prompt"], answer=x["answer"], reward=x["reward"]) for x in lines[:G]]
    record = progress.rollout_record(answers, generated - start, time.perf_counter() - generated)
    record |= {"problems": [p["task_id"] for p in chosen[::G]]}
    record["audit"] = sum(x["audit"] for x in lines if x["reward"])  # passed, but flagged
    seqs = list(zip(prompts, answers, strict=True))
    return dict(seqs=seqs, rewards=rewards, answers=lines, samples=shown, record=record)


def advantages(rewards, group_size: int, scale: bool = True):
    """rewards (N,) in groups of G -> advantages (N,), step 3."""
    r = rewards.view(-1, group_size)
    centred = r - r.mean(1, keepdim=True)
    return (centred / (r.std(1, keepdim=True) + 1e-4) if scale else centred).flatten()


# ----------------------------------------------------------------------------- the loss
def micro_batches(seqs, max_tokens):
    """The step's (prompt, answer) ids in rows of at most max_tokens tokens (a longer one alone), a
    group's answers after one copy of their prompt (one that does not fit goes on in the next row,
    its prompt again)."""
    rows = []
    used = 0
    for prompt, answer in seqs:
        same = bool(rows) and rows[-1][-1][0] == prompt  # answers the row's last prompt
        grown = used + len(answer) + (0 if same else len(prompt))
        if not rows or (used and grown > max_tokens):
            rows.append([])
            used = 0
            same = False
        if not same:
            rows[-1].append((prompt, []))
            used += len(prompt)
        rows[-1][-1][1].append(answer)
        used += len(answer)
    return [packed_row(row) for row in rows]


def group_tokens(seqs, cfg: RLConfig) -> int:
    """micro_batch_tokens "auto": the longest group's tokens (a mask grows with the square)."""
    G = cfg.group_size
    groups = range(0, len(seqs), G)
    return max(len(seqs[g][0]) + sum(len(a) for _, a in seqs[g : g + G]) for g in groups)


def packed_row(row):
    """One row from its pieces [(prompt, [answers])], as the docstring's table: ids and position_ids
    (1, L); mask (1, L, L); where (m,), the positions whose logits predict answer tokens, and
    targets (m,), those tokens."""
    ids, pos, where = [], [], []
    seg = []  # each token's piece: the index of its first token
    sees = []  # the prompt piece it also sees
    for prompt, answers in row:
        p = len(prompt)
        first = len(seg)
        ids += prompt
        pos += range(p)
        seg += [first] * p
        sees += [first] * p
        for a in filter(None, answers):  # an empty answer has no token to predict
            where += [first + p - 1, *range(len(ids), len(ids) + len(a) - 1)]
            seg += [len(seg)] * len(a)
            sees += [first] * len(a)
            ids += a
            pos += range(p, p + len(a))
    seg = torch.tensor(seg)
    sees = torch.tensor(sees)
    at = torch.arange(len(ids))
    same = (seg[None] == seg[:, None]) | (seg[None] == sees[:, None])
    mask = (at[None] <= at[:, None]) & same  # (L, L)
    targets = [t for _, answers in row for a in answers for t in a]
    out = dict(ids=torch.tensor([ids]), position_ids=torch.tensor([pos]), mask=mask[None])
    return out | dict(where=torch.tensor(where), targets=torch.tensor(targets))


def token_logprobs(model, batch, temperature, place):
    """(lp, entropy), both (m,): log softmax(logits / T) of a micro-batch's answer tokens, from the
    training forward, and the entropy of each token's distribution (no gradient); logits (m, vocab)
    at `where` only, in fp32."""
    with place.autocast():
        batch = {k: v.to(place.device) for k, v in batch.items()}
        logits = model(batch["ids"], batch["position_ids"], only=batch["where"], mask=batch["mask"])
    logits = logits.float() / temperature
    logp = logits.log_softmax(-1)
    with torch.no_grad():
        entropy = -(logp.exp() * logp).sum(-1)
    return logp.gather(-1, batch["targets"][:, None])[:, 0], entropy


def token_weights(lengths, loss_norm: str, sample_tokens: int):
    """w (n,): each answer token's weight, for answers of `lengths` (N,)."""
    n = torch.as_tensor(lengths)
    if loss_norm == "token":
        per_answer = 1 / n.sum().float()
    elif loss_norm == "sequence":
        per_answer = 1 / (n.float() * len(n))
    else:
        per_answer = torch.tensor(1 / (len(n) * sample_tokens))
    return per_answer.expand(len(n)).repeat_interleave(n)


def grpo_loss(lp, lp_old, lp_ref, adv, w, cfg: RLConfig):
    """The clipped surrogate plus the KL penalty, weighted (step 4), all (m,) over answer tokens;
    lp_ref None without the penalty. Returns (loss, the tokens' k3 KL or None)."""
    ratio = torch.exp(lp - lp_old)
    clipped = ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps)
    per_token = -torch.min(ratio * adv, clipped * adv)
    kl = None if lp_ref is None else torch.exp(lp_ref - lp) - (lp_ref - lp) - 1
    if kl is not None and cfg.kl_coef:
        per_token = per_token + cfg.kl_coef * kl * ratio
    return (per_token * w).sum(), kl


# ----------------------------------------------------------------------------- the step
class Part(NamedTuple):
    """One micro-batch of a step and its answer tokens' (m,) tensors."""

    batch: dict
    adv: torch.Tensor
    w: torch.Tensor
    lp_old: torch.Tensor | None  # only when a batch makes more than one update
    lp_ref: torch.Tensor | None  # only when the KL is weighed


def prepare(cfg: RLConfig, run, roll: dict) -> list[Part]:
    """The step's micro-batches with their advantages, weights, lp_old and lp_ref, the last two
    computed before any update (lp_ref with the adapters off); without lp_old each update uses its
    own lp, detached."""
    lengths = torch.tensor([len(a) for _, a in roll["seqs"]])
    adv = advantages(roll["rewards"], cfg.group_size, cfg.scale_rewards).repeat_interleave(lengths)
    w = token_weights(lengths, cfg.loss_norm, cfg.sample_tokens)
    limit = cfg.micro_batch_tokens
    limit = limit if isinstance(limit, int) else group_tokens(roll["seqs"], cfg)  # "auto": about a group
    window = min(layer.self_attn.window or math.inf for layer in run.model.model.layers)
    batches = micro_batches(roll["seqs"], min(limit, window))  # a mask knows no window
    old = all_logprobs(cfg, run, batches) if cfg.updates_per_batch > 1 else None
    ref = None
    if cfg.kl_coef:
        with lora.adapters_off(run.model):  # the reference: this model as its base
            ref = all_logprobs(cfg, run, batches)
    sizes = [len(b["targets"]) for b in batches]
    split = [[None] * len(sizes) if x is None else x.to(run.place.device).split(sizes) for x in (adv, w, old, ref)]
    return [Part(b, *rest) for b, *rest in zip(batches, *split, strict=True)]


@torch.no_grad()
def all_logprobs(cfg, run, batches):
    """lp (n,) of every answer token of the step, without gradient."""
    return torch.cat([token_logprobs(run.model, b, cfg.temperature, run.place)[0] for b in batches])


def backward(cfg: RLConfig, run, parts) -> dict:
    """One update's forward and backward over the micro-batches, gradients summed: its loss, its
    tokens' mean entropy and mean KL (when weighed)."""
    loss = torch.zeros((), dtype=torch.float64)
    kls = []
    entropies = []
    for b, adv, w, old, ref in parts:
        lp, entropy = token_logprobs(run.model, b, cfg.temperature, run.place)
        part, kl = grpo_loss(lp, lp.detach() if old is None else old, ref, adv, w, cfg)
        run.scaler.scale(part).backward()
        loss += part.detach().double().cpu()
        entropies.append(entropy)
        if kl is not None:
            kls.append(kl.detach())
    record = {"loss": loss.item(), "entropy": float(torch.cat(entropies).mean())}
    return record | ({"kl": float(torch.cat(kls).mean())} if kls else {})


def grpo_step(cfg: RLConfig, run, roll: dict) -> dict:
    """updates_per_batch updates on one rollout; the record of the first (its loss and KL), the last
    one's gradient norm."""
    start = time.perf_counter()
    params = [p for group in run.opt.param_groups for p in group["params"]]
    parts = prepare(cfg, run, roll)
    for update in range(cfg.updates_per_batch):
        losses = backward(cfg, run, parts)
        run.scaler.unscale_(run.opt)
        norm = float(torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip or math.inf))
        if update == 0:  # the step's record: the loss, entropy and KL of the policy that sampled
            record = losses
        if not stopping.finite(record | {"grad_norm": norm}, run.scaler):
            return record | {"grad_norm": norm}  # never applied; the loop stops
        run.scaler.step(run.opt)
        run.scaler.update()
        run.opt.zero_grad(set_to_none=True)
    tokens = sum(len(p) + len(a) for p, a in roll["seqs"]) * cfg.updates_per_batch
    seconds = time.perf_counter() - start
    return record | {"grad_norm": norm, "train_s": seconds, "train_tokens_per_s": tokens / seconds}


def rl_step(run, problems) -> tuple[dict, list]:
    """Step run.step: a rollout, its rewards, the updates. Returns its record and the first group's
    answers with their rewards."""
    cfg = run.cfg
    lr = train.learning_rate(cfg, run.step)
    for group in run.opt.param_groups:
        group["lr"] = lr
    roll = rollout(cfg, run, problems, run.step)
    rewards = roll["rewards"]
    record = {"step": run.step + 1, "lr": lr, "reward": float(rewards.mean()), "reward_std": float(rewards.std())}
    record["no_signal"] = float((rewards.view(-1, cfg.group_size).std(1) == 0).float().mean())
    record |= roll["record"]
    if run.place.main:
        answer_log.append(cfg.out_dir, roll["answers"])
    if cfg.shuffle_rewards:  # the control: each reward given to a random answer of its group
        roll["rewards"] = shuffled(rewards, cfg.group_size, cfg.seed * 1_000_003 + run.step)
    if cfg.skip_no_signal:
        roll = with_signal(roll, cfg.group_size)
    # a step without a group with signal (all skipped) has nothing to learn: no update
    record |= grpo_step(cfg, run, roll) if roll["seqs"] else {"loss": 0.0, "grad_norm": 0.0}
    stopping.stop_unless_finite(run, record)
    run.step += 1
    return record, roll["samples"]


def shuffled(rewards, group_size: int, seed: int):
    """The control's rewards (N,): each group's permuted at random, blind to the answers."""
    gen = torch.Generator().manual_seed(seed)
    order = torch.stack([torch.randperm(group_size, generator=gen) for _ in range(len(rewards) // group_size)])
    return rewards.view(-1, group_size).gather(1, order).flatten()


def with_signal(roll: dict, group_size: int) -> dict:
    """The rollout without its groups of one reward (DAPO's dynamic sampling, by skipping)."""
    keep = (roll["rewards"].view(-1, group_size).std(1) > 0).repeat_interleave(group_size)
    seqs = [seq for seq, kept in zip(roll["seqs"], keep.tolist(), strict=True) if kept]
    return roll | {"seqs": seqs, "rewards": roll["rewards"][keep]}


# ----------------------------------------------------------------------------- the run
def build_policy(cfg: RLConfig, place, model_dir):
    """train.py's QLoRA model without dropout (sampling and the loss see one policy), and its
    optimizer."""
    torch.manual_seed(cfg.seed)  # the adapters' init
    adapters = cfg.adapters() | dict(lora_dtype=torch.float32)
    options = Options(cfg.activation_checkpointing, cfg.offload_checkpoints)
    model = train.load_model(model_dir, place.dtype, place.device, cfg.quantize, adapters, options=options)
    params = [p for p in model.parameters() if p.requires_grad]
    return model, train.make_optimizer(cfg, params, place.device)


def rl(cfg: RLConfig) -> list[dict]:
    """Train as `cfg` says; returns the metrics history (step 0's record, then one per step)."""
    config.check_config(cfg, config.rl_conflicts(cfg))
    task = humaneval.task_problems(cfg)  # a bad eval_task file fails first
    model_dir = run_dir.find_model(cfg)
    run_dir.data_files(cfg, [] if cfg.data == "easy" else ["data"])  # a missing file named as `data`
    tok = Tokenizer(model_dir)
    problems, said = problem_sets.training_problems(cfg, tok)  # fails with nothing in out_dir
    cfg = dataclasses.replace(cfg, out_dir=run_dir.claim_out_dir(cfg))
    print(f"{said}; {cfg.problems_per_step} x {cfg.group_size} answers a step")
    place = ranks.setup(cfg)
    run = lifecycle.open_run(cfg, place, tok, model_dir, task, lambda p: build_policy(cfg, p, model_dir))
    resumed = lifecycle.resume(run)
    answer_log.keep_until(cfg.out_dir, run.step)  # a fresh run: none
    if cfg.learnable_only:  # those the base model sometimes passes
        problems = problem_sets.learnable(cfg, run.model, tok, problems, place.autocast)
    if not resumed and cfg.eval_every:  # a fresh run: eval_task's pass@1 before training
        if record := humaneval.task_record(cfg, run.model, tok, task, place.autocast, 0):
            lifecycle.keep(run, {"step": 0} | record)
    loop(run, problems)
    return lifecycle.close_run(run)


def loop(run, problems):
    """Steps from run.step to max_steps, each followed by what is due: at evaluations a group's
    answers and eval_task; a checkpoint. Ctrl-C stops after the step under way, with a checkpoint of
    exactly that step."""
    cfg = run.cfg
    with lifecycle.steps(run) as stop_asked:
        while run.step < cfg.max_steps and not stop_asked():
            record, samples = rl_step(run, problems)
            if lifecycle.evaluation_due(run) and not stop_asked():
                record["samples"] = samples
                args = (run.model, run.tok, run.task, run.place.autocast, run.step)
                record |= humaneval.task_record(cfg, *args)
            lifecycle.end_step(run, record, progress.rl_step_line(record))
    lifecycle.end_loop(run)


def main(argv=None):
    """The command: a config file and --key=value flags; a user's mistake is one line."""
    argv = sys.argv[1:] if argv is None else argv
    unused = (train.Config, "train.py's setting, which rl.py does not use")
    ranks.one_line_errors(lambda: rl(config.load_config(RLConfig, argv, elsewhere=unused)))


if __name__ == "__main__":
    main()
