"""rl.py: GRPO over LoRA, rewarded in the sandbox.

What this file proves: on identical prompts, completions, rewards and old log-probabilities, the step's loss and the
adapters' gradients equal TRL's GRPOTrainer (its own advantages from the rewards, its own log-probabilities and
reference) within 1e-6 in fp32, for the three normalisations (TRL's "dapo", "grpo", "dr_grpo"), with the KL penalty and
without, with and without the group's std, and with old log-probabilities that make the clip act; with the adapters
switched off the QLoRA model's log-probabilities are the base model's bit for bit (the free reference policy); answers
that share one copy of their prompt get the log-probabilities they get alone; the mean token entropy equals the one TRL
logs; a run stopped and resumed equals one run straight through (losses, rewards, adapters, and answers.jsonl line for
line); the control's shuffled rewards keep each group's rewards,
and skipping groups without signal drops exactly those (a step with none makes no update); a bad problem file or a
setting of train.py's own is one line, with nothing written.
"""

import json
import os
import signal

import pytest
import torch
from conftest import fixed_outcome_problems

import lora
import rl
import train
from support.run import lifecycle, ranks
from support.run.config import load_config

G, PROMPT, ANSWERS = 3, 7, [5, 2, 9, 4, 4, 7]  # group size, prompt tokens, the answers' lengths (two groups)
REWARDS = [1.0, 0.0, 1.0, 0.0, 0.0, 0.0]  # the second group has no signal


def peft_names(name):
    """Our adapter parameter's name as PEFT (wrapped by TRL) calls it."""
    return "base_model.model." + name.replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default.")


def trl_trainer(tiny_dir, tmp_path, loss_type, beta, scale, iterations):
    """TRL's GRPOTrainer over transformers' Llama from tiny_dir with a PEFT LoRA (r=4, alpha=8, no dropout), whose
    rollout gives our fixed prompts and completions and whose reward function gives REWARDS."""
    import transformers
    from datasets import Dataset
    from peft import LoraConfig
    from trl import GRPOConfig, GRPOTrainer

    os.environ["TRL_EXPERIMENTAL_SILENCE"] = "1"
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 49152, (PROMPT,), generator=gen).tolist() for _ in range(len(ANSWERS) // G)]
    answers = [torch.randint(0, 49152, (n,), generator=gen).tolist() for n in ANSWERS]

    def rollout(batch, trainer):
        ids = [prompts[i // G] for i in range(len(batch))]
        return {"prompt_ids": ids, "completion_ids": answers, "logprobs": [[0.0] * len(a) for a in answers]}

    def reward(prompts, completions, **kwargs):
        return REWARDS

    args = GRPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=len(ANSWERS), num_generations=G,
                      max_completion_length=max(ANSWERS) + 3, loss_type=loss_type, beta=beta, num_iterations=iterations,
                      scale_rewards="group" if scale else "none", use_cpu=True, bf16=False, report_to="none",
                      temperature=0.7, gradient_checkpointing=False)  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float32)
    peft = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules="all-linear")
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    data = Dataset.from_list([{"prompt": "p0"}, {"prompt": "p1"}])
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=data, processing_class=tok,
                          peft_config=peft, rollout_func=rollout)  # fmt: skip
    return trainer, prompts, answers


NORMS = {"token": "dapo", "sequence": "grpo", "constant": "dr_grpo"}


@pytest.mark.parametrize(
    "norm, kl_coef, scale, clipped",
    [("token", 0.0, True, False), ("token", 0.04, True, True), ("sequence", 0.0, True, False),
     ("sequence", 0.04, False, False), ("constant", 0.04, True, False), ("constant", 0.0, False, True)],
)  # fmt: skip
def test_loss_and_gradients_equal_trls(tiny_dir, tmp_path, norm, kl_coef, scale, clipped):
    """TRL's GRPOTrainer scores our fixed rollout (its advantages from REWARDS, its lp and, with beta, its reference
    with the adapters disabled) and computes its loss; ours computes the same step from the same rewards through
    rl.prepare and rl.backward. With `clipped`, both get the same old log-probabilities, moved by up to +-0.5 from the
    policy's, so that ratios leave [0.8, 1.2] and the clip acts. Loss and every adapter gradient agree within 1e-6, the
    mean token entropy TRL logs within 1e-5."""
    trainer, prompts, answers = trl_trainer(tiny_dir, tmp_path, NORMS[norm], kl_coef, scale, 2 if clipped else 1)
    hf = trainer.model
    with torch.no_grad():  # B away from zero, so that A's gradients are not zero too
        gen = torch.Generator().manual_seed(3)
        for name, p in hf.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=gen)
    inputs = trainer._generate_and_score_completions([{"prompt": f"p{i // G}"} for i in range(len(ANSWERS))])
    mask = inputs["completion_mask"].bool()
    if clipped:
        shift = torch.rand(mask.shape, generator=torch.Generator().manual_seed(2)) - 0.5
        inputs["old_per_token_logps"] = inputs["old_per_token_logps"] + shift
    hf.train()
    trainer.current_gradient_accumulation_steps = 1  # what its training loop sets before each step: one micro-batch
    theirs = trainer._compute_loss(hf, inputs)
    theirs.backward()

    model = train.load_model(tiny_dir, torch.float32, add_lora=dict(targets="all-linear", r=4, alpha=8, dropout=0.0))
    with torch.no_grad():
        named = dict(hf.named_parameters())
        for name, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(named[peft_names(name)])
    cfg = rl.RLConfig(group_size=G, loss_norm=norm, kl_coef=kl_coef, scale_rewards=scale, temperature=0.7,
                      sample_tokens=max(ANSWERS) + 3, updates_per_batch=2 if clipped else 1)  # fmt: skip
    place = ranks.Placement(0, 1, torch.device("cpu"))
    run = lifecycle.Run(cfg, place, None, None, model, None, torch.amp.GradScaler("cuda", enabled=False), [])
    roll = dict(seqs=[(prompts[i // G], a) for i, a in enumerate(answers)], rewards=torch.tensor(REWARDS))
    parts = rl.prepare(cfg, run, roll)
    if clipped:  # TRL's old log-probabilities, for ours: the answers' tokens in order, without the padding
        old = inputs["old_per_token_logps"][mask].split([len(b["targets"]) for b, *_ in parts])
        parts = [(b, a, w, o, r) for (b, a, w, _, r), o in zip(parts, old, strict=True)]
    record = rl.backward(cfg, run, parts)
    ours = record["loss"]
    assert abs(ours - theirs.item()) < 1e-6, (ours, theirs.item())
    entropy = trainer._metrics["train"]["entropy"][-1]  # the policy's mean token entropy, as TRL logs it
    assert abs(record["entropy"] - entropy) < 1e-5 and entropy > 0, (record["entropy"], entropy)
    grads = {name: p.grad for name, p in model.named_parameters() if p.requires_grad}
    assert all(g is not None and g.abs().max() > 0 for g in grads.values())
    worst = max((g - named[peft_names(n)].grad).abs().max().item() for n, g in grads.items())
    assert worst < 1e-6, worst


def test_adapters_off_is_the_base_model_bit_for_bit(tiny_dir):
    """The QLoRA model with trained-looking adapters (B away from zero), its adapters switched off, gives the answer
    tokens' log-probabilities of the NF4 base model loaded without adapters, bit for bit, and so does the reference
    the step computes (rl.prepare); with the adapters on they differ."""
    base = train.load_model(tiny_dir, torch.float32, quantize=True)
    model = train.load_model(tiny_dir, torch.float32, quantize=True, add_lora=dict(targets="all-linear", r=4, alpha=8,
                                                                                    dropout=0.0))  # fmt: skip
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    gen = torch.Generator().manual_seed(0)
    tokens = lambda n: torch.randint(0, 49152, (n,), generator=gen).tolist()  # noqa: E731
    seqs = [(tokens(6), tokens(n)) for n in (4, 9, 2)]
    batch = rl.micro_batches(seqs, 1000)[0]
    place = ranks.Placement(0, 1, torch.device("cpu"))
    with torch.no_grad():
        want, adapted = (rl.token_logprobs(m, batch, 0.7, place)[0] for m in (base, model))
        with lora.adapters_off(model):
            assert torch.equal(rl.token_logprobs(model, batch, 0.7, place)[0], want)
    assert not torch.equal(adapted, want)
    cfg = rl.RLConfig(kl_coef=0.1, temperature=0.7, group_size=3, micro_batch_tokens=1000)
    run = lifecycle.Run(cfg, place, None, None, model, None, None, [])
    parts = rl.prepare(cfg, run, dict(seqs=seqs, rewards=torch.tensor([1.0, 0.0, 1.0])))
    assert torch.equal(torch.cat([ref for *_, ref in parts]), want)


TEST = "def check(c):\n    text = c()\n    assert {}\n"  # the answer's function returns its sampled text
PROBLEMS = [  # whose tests look at it: rewards that vary with what is sampled
    dict(task_id=name, prompt="def f():\n", entry_point="f", test=TEST.format(condition))
    for name, condition in (("even", "len(text) % 2 == 0"), ("e", "'e' in text"), ("three", "len(text) % 3"))
]


def returning_text(text, chat):
    """In place of humaneval.completion: the body of a function returning the sampled text, so that the judge, in
    another process, sees the text through the answer's function."""
    return f"    return {text!r}\n"


def rl_args(tiny_dir, tmp_path, *extra):
    """A seconds-long rl.py run of the tiny random Llama on PROBLEMS, whose rewards depend on the sampled text."""
    data = tmp_path / "problems.jsonl"
    tmp_path.mkdir(exist_ok=True)
    data.write_text("".join(json.dumps(p) + "\n" for p in PROBLEMS))
    return [f"--model={tiny_dir}", f"--data={data}", f"--out_dir={tmp_path / 'out'}", "--group_size=4",
            "--problems_per_step=2", "--sample_tokens=12", "--context_length=64", "--max_steps=4", "--lora_r=4",
            "--lr=3e-3", "--warmup_steps=0", "--min_lr_ratio=1.0", "--precision=fp32", "--eval_every=2",
            "--save_every=0", "--kl_coef=0.1", "--updates_per_batch=2", *extra]  # fmt: skip


STEADY = ("step", "lr", "reward", "reward_std", "no_signal", "answer_tokens", "problems", "loss", "grad_norm", "kl")


def test_answers_share_one_copy_of_their_prompt(tiny_dir):
    """micro_batches puts a group's prompt once in a row, its answers after it seeing only it and themselves: each
    answer token's log-probability equals the one its (prompt, answer) alone gives, within 1e-5 in fp32, whether the
    group fits one row or is split across rows (its prompt again in the next)."""
    model = train.load_model(tiny_dir, torch.float32, add_lora=dict(targets="all-linear", r=4, alpha=8, dropout=0.0))
    gen = torch.Generator().manual_seed(4)
    tokens = lambda n: torch.randint(0, 49152, (n,), generator=gen).tolist()  # noqa: E731
    prompts = [tokens(PROMPT), tokens(PROMPT + 3)]
    seqs = [(prompts[i // G], tokens(n)) for i, n in enumerate(ANSWERS)]
    place = ranks.Placement(0, 1, torch.device("cpu"))
    with torch.no_grad():
        alone = torch.cat([rl.token_logprobs(model, rl.micro_batches([s], 1000)[0], 0.7, place)[0] for s in seqs])
        # rows of at most 16 tokens: [7 + 5 + 2], [7 + 9], [10 + 4], [10 + 4], [10 + 7] (longer, alone)
        for limit, lengths in ((1000, [7 + 5 + 2 + 9 + 10 + 4 + 4 + 7]), (16, [14, 16, 14, 14, 17])):
            batches = rl.micro_batches(seqs, limit)
            assert [b["ids"].shape[1] for b in batches] == lengths
            shared = torch.cat([rl.token_logprobs(model, b, 0.7, place)[0] for b in batches])
            assert shared.shape == alone.shape and (shared - alone).abs().max() < 1e-5


def test_a_stopped_and_resumed_run_equals_one_run_straight_through(tiny_dir, tmp_path, monkeypatch, capsys):
    """Ctrl-C during step 2 ends the run after that step with its checkpoint; resumed, it gives every step's problems,
    rewards, loss and KL, and the final adapters, exactly as the run that was never stopped. The rewards vary within
    groups and the adapters move, so there is something to get wrong."""
    monkeypatch.setattr(rl.humaneval, "completion", returning_text)
    full = rl.rl(load_config(rl.RLConfig, rl_args(tiny_dir, tmp_path / "full")))
    real = rl.problem_sets.step_problems

    def interrupt(seed, per_step, n, step):
        if step == 1:
            signal.raise_signal(signal.SIGINT)
        return real(seed, per_step, n, step)

    with monkeypatch.context() as m, pytest.raises(SystemExit) as e:
        m.setattr(rl.problem_sets, "step_problems", interrupt)
        rl.rl(load_config(rl.RLConfig, rl_args(tiny_dir, tmp_path / "stopped")))
    assert e.value.code == 130 and "interrupted: checkpoint at step 2" in capsys.readouterr().out
    resumed = rl.rl(load_config(rl.RLConfig, rl_args(tiny_dir, tmp_path / "stopped", "--resume")))
    steady = lambda history: [{k: r.get(k) for k in STEADY} for r in history if "loss" in r]  # noqa: E731
    assert steady(resumed) == steady(full) and len(steady(full)) == 4
    assert any(r["no_signal"] < 1 for r in full) and any(r["loss"] != 0 for r in full)
    logs = [(tmp_path / d / "out" / "answers.jsonl").read_text().splitlines() for d in ("full", "stopped")]
    assert logs[0] == logs[1] and len(logs[0]) == 4 * 2 * 4  # steps x problems x group_size
    assert [json.loads(line)["step"] for line in logs[0]] == [s for s in range(1, 5) for _ in range(8)]
    a, b = (torch.load(tmp_path / d / "out" / "checkpoint.pt", weights_only=True)["lora"] for d in ("full", "stopped"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert any(v.abs().max() > 0 for k, v in a.items() if "lora_B" in k)


def test_shuffled_rewards_stay_in_their_groups():
    """The control's rewards: each group's rewards permuted among its answers, seeded, and not left in place."""
    rewards = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 1, 0, 0, 0, 1])
    shuffled = rl.shuffled(rewards, 4, seed=1)
    assert torch.equal(shuffled, rl.shuffled(rewards, 4, seed=1)) and not torch.equal(shuffled, rewards)
    assert all(
        sorted(a.tolist()) == sorted(b.tolist()) for a, b in zip(shuffled.view(3, 4), rewards.view(3, 4), strict=True)
    )


def test_skipping_groups_without_signal(tiny_dir, tmp_path, monkeypatch):
    """with_signal drops exactly the groups of one reward. In a run with skip_no_signal whose problems all pass or all
    fail whatever the model writes, no step has a group with signal: every loss and gradient norm is 0 and the adapters
    never move from their start."""
    roll = dict(seqs=[([1], [i]) for i in range(6)], rewards=torch.tensor(REWARDS))
    kept = rl.with_signal(roll, G)
    assert kept["seqs"] == roll["seqs"][:3] and torch.equal(kept["rewards"], torch.tensor(REWARDS[:3]))
    path = fixed_outcome_problems(tmp_path / "fixed.jsonl")
    args = rl_args(tiny_dir, tmp_path, "--skip_no_signal=True", "--kl_coef=0", "--eval_every=0", "--max_steps=2")
    history = rl.rl(load_config(rl.RLConfig, [*args, f"--data={path}"]))
    assert [(r["loss"], r["grad_norm"], r["no_signal"]) for r in history] == [(0.0, 0.0, 1.0)] * 2
    lora_b = torch.load(tmp_path / "out" / "checkpoint.pt", weights_only=True)["lora"]
    assert all(not v.any() for k, v in lora_b.items() if "lora_B" in k)


def test_a_bad_problem_file_is_one_line_and_writes_nothing(tiny_dir, tmp_path, capsys):
    """A problem file with a missing field stops rl.py with one line naming the file and line, before out_dir exists."""
    args = rl_args(tiny_dir, tmp_path)
    (tmp_path / "problems.jsonl").write_text(json.dumps({k: v for k, v in PROBLEMS[0].items() if k != "test"}) + "\n")
    with pytest.raises(SystemExit) as e:
        rl.main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err == [f"error: {tmp_path / 'problems.jsonl'}:1: missing field 'test' (a problem has "
                                         "task_id, prompt, test, entry_point)"]  # fmt: skip
    assert not (tmp_path / "out").exists()


def test_train_only_settings_are_refused_in_one_line(tiny_dir, tmp_path, capsys):
    """A setting of train.py's own (not train.Common's) given to rl.py is refused in one line saying so, not guessed at
    as a misspelling of one of rl.py's, before out_dir exists."""
    with pytest.raises(SystemExit) as e:
        rl.main(rl_args(tiny_dir, tmp_path, "--batch_tokens=1024"))
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and err == [
        "error: --batch_tokens: batch_tokens is train.py's setting, which rl.py does not use"
    ]
    assert not (tmp_path / "out").exists()
