"""support/data/problems.py: the problems rl.py trains on.

What this file proves: the standard library holds about 290 functions and methods with doctests, found with their
signature + docstring as the prompt and their own body as the canonical solution; a problem's test runs the doctests
against the answer in the function's module (its helpers in scope, a method put back on its class): the original body
passes, a wrong one fails; a problem whose doctests pass any answer (+SKIP) is left out; the prompt shows half the
examples, and answers that look up the shown examples, or all of them, fail. A user's file: every mistake
is one line naming the file and line (a missing field, a canonical_solution that fails its test or is not text, a
prompt with no room for an answer), and a good file loads whole. data "easy" draws the easy family's training
templates; a step's problems are a function of (seed, step); the learnable band keeps exactly the problems some but
not all of whose answers passed, and says how many of each kind there were, its answers sampled from the base model
(adapters off, so trained adapters change nothing).
"""

import json
from contextlib import nullcontext

import pytest
import torch
from conftest import fixed_outcome_problems

import rl
from support.data import easy, problems
from support.data.tokenizer import Tokenizer
from support.evaluation import humaneval, sandbox
from train import load_model


@pytest.fixture
def candidates(stdlib_candidates):
    return stdlib_candidates


def test_the_stdlib_holds_about_290_doctested_functions(candidates):
    """Python 3.11 has 288 doctested functions and methods, 282 without a decorator; each becomes a problem with
    HumanEval's fields and its own body as canonical_solution, the prompt naming the function above its signature."""
    assert 250 <= len(candidates) <= 400
    median = candidates["stdlib/statistics.median"]
    assert set(median) == {*humaneval.FIELDS, "serve", "canonical_solution"} and median["entry_point"] == "median"
    assert median["prompt"].startswith("# statistics.median, from Python's standard library\ndef median(data):\n")
    assert ">>> median([1, 3, 5])" in median["prompt"] and "return" in median["canonical_solution"]
    assert (
        candidates["stdlib/fractions.Fraction.limit_denominator"]["prompt"]
        .splitlines()[1]
        .startswith("def limit_denominator(self")
    )


def test_a_problem_runs_its_doctests_against_the_answer_in_its_module(candidates):
    """The original bodies pass, in the sandbox: a module-level function using its module's helpers (statistics.median
    calls sorted and raises StatisticsError), and a method (Counter.most_common, put back on Counter); an answer off by
    one fails with the count of failed examples; an answer that only raises fails."""
    median, common = candidates["stdlib/statistics.median"], candidates["stdlib/collections.Counter.most_common"]
    wrong = "    data = sorted(data)\n    return data[len(data) // 2 - 1]\n"
    answers = [(median, median["canonical_solution"]), (median, wrong), (common, common["canonical_solution"])]
    verdicts = sandbox.run_many([humaneval.answer(p, a) for p, a in [*answers, (common, problems.STUB)]])
    assert verdicts[0] == "passed" and verdicts[2] == "passed"
    assert verdicts[1].startswith("failed: AssertionError:") and "doctest examples failed" in verdicts[1]
    assert verdicts[3].startswith("failed")


def test_stdlib_problems_keeps_the_decisive_tests(candidates, monkeypatch):
    """Of three candidates (too_long leaves out the rest), statistics.median and statistics.mode are kept, the shorter
    canonical solution first, and secrets.token_hex, whose doctest is marked +SKIP and so passes anything, is left
    out."""
    keep = {"stdlib/statistics.median", "stdlib/statistics.mode", "stdlib/secrets.token_hex"}
    assert "+SKIP" in candidates["stdlib/secrets.token_hex"]["prompt"]
    monkeypatch.setattr(problems, "stdlib_candidates", lambda: list(candidates.values()))  # parsed once, by the fixture
    found, said = problems.stdlib_problems(too_long=lambda p: "" if p["task_id"] in keep else "left out")
    assert {p["task_id"] for p in found} == {"stdlib/statistics.median", "stdlib/statistics.mode"}
    n = len(candidates)
    assert (
        said
        == f"2 of {n} doctested stdlib functions (1 whose test does not decide, {n - 3} without room for an answer)"
    )
    assert [len(p["canonical_solution"]) for p in found] == sorted(len(p["canonical_solution"]) for p in found)


def test_a_limit_judges_only_as_many_as_it_keeps(candidates, monkeypatch):
    """With a limit, stdlib_problems keeps the same first problems as without one (the shortest canonical solutions
    whose tests decide) but judges only the candidates it needs, in that order, a batch at a time, and says how many
    it judged. The judge is a stand-in that keeps every third candidate (the real one, two sandboxed programs a
    candidate, is proven by test_stdlib_problems_keeps_the_decisive_tests)."""
    order = lambda t: (len(candidates[t]["canonical_solution"]), t)  # noqa: E731
    names = sorted(candidates, key=order)[:40]
    only = lambda p: "" if p["task_id"] in names else "left out"  # noqa: E731
    judged = []

    def stand_in(batch, confine):
        judged.extend(p["task_id"] for p in batch)
        return ["" if names.index(p["task_id"]) % 3 == 0 else "does not decide" for p in batch]

    monkeypatch.setattr(problems, "left_out", stand_in)
    monkeypatch.setattr(problems, "stdlib_candidates", lambda: list(candidates.values()))  # parsed once, by the fixture
    whole, _ = problems.stdlib_problems(too_long=only)
    assert judged == names and [p["task_id"] for p in whole] == names[::3]
    judged.clear()
    first, said = problems.stdlib_problems(too_long=only, limit=3)
    assert [p["task_id"] for p in first] == [p["task_id"] for p in whole[:3]]
    assert judged == names[:16]
    assert said.startswith(f"3 of {len(candidates)} doctested stdlib functions, the first 16 judged (")
    judged.clear()
    first, _ = problems.stdlib_problems(too_long=only, limit=10)  # 20 judged, 7 kept; then 16 more (at least 16)
    assert [p["task_id"] for p in first] == [p["task_id"] for p in whole[:10]] and judged == names[:36]


ADD = dict(task_id="add", prompt="def add(a, b):\n", entry_point="add",
           test="def check(candidate):\n    assert candidate(2, 3) == 5\n")  # fmt: skip


def write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize(
    "row, message",
    [
        ({k: v for k, v in ADD.items() if k != "test"}, r":3: missing field 'test'"),
        (ADD | {"task_id": "b", "canonical_solution": "    return a - b\n"},
         r":3: canonical_solution does not pass its test \(failed: AssertionError"),
        (ADD | {"task_id": "b", "canonical_solution": 7}, r":3: canonical_solution must be a string"),
        (ADD | {"task_id": "b", "prompt": "def add(a, b):\n" + "    # a long comment\n" * 40},
         r":3: prompt of \d+ words \+ 8 exceeds 100"),
    ],
    ids=["missing-field", "canonical-fails", "canonical-not-text", "prompt-too-long"],
)  # fmt: skip
def test_a_bad_problem_file_is_one_line_naming_its_line(tmp_path, row, message):
    """Each mistake of a user's problem file is one ValueError line naming the file and the line (line 3: a blank line
    before it counts)."""
    path = write(tmp_path / "p.jsonl", [ADD | {"canonical_solution": "    return a + b\n"}, "", row])
    too_long = lambda p: (
        "" if len(p["prompt"].split()) < 100 else f"prompt of {len(p['prompt'].split())} words + 8 exceeds 100"
    )  # noqa: E731
    with pytest.raises(ValueError, match=rf"^{path}{message}") as e:
        problems.read_problems(path, too_long)
    assert "\n" not in str(e.value)


def test_a_good_problem_file_loads(tmp_path):
    """Problems with and without a canonical_solution load, in order, with HumanEval's four fields."""
    path = write(tmp_path / "p.jsonl", [ADD | {"canonical_solution": "    return a + b\n"}, ADD | {"task_id": "b"}])
    assert problems.read_problems(path) == (
        [ADD, ADD | {"task_id": "b"}],
        f"2 of 2 problems in {path} (0 cannot cross)",
    )


def test_what_the_prompt_does_not_show_decides(candidates):
    """statistics.median's prompt shows the first of its two examples, not the second, which its test still runs: an
    answer that looks up the shown example fails on the hidden one; an answer that looks up both fails when the test
    calls it again on altered inputs and compares with the original; the original passes."""
    median = candidates["stdlib/statistics.median"]
    assert "median([1, 3, 5])" in median["prompt"] and "median([1, 3, 5, 7])" not in median["prompt"]
    shown = "    if data == [1, 3, 5]:\n        return 3\n    return None\n"
    both = "    if data == [1, 3, 5, 7]:\n        return 4.0\n" + shown
    answers = [humaneval.answer(median, a) for a in (shown, both, median["canonical_solution"])]
    verdicts = sandbox.run_many(answers)
    assert verdicts[0] == "failed: AssertionError: 1 of 2 doctest examples failed"
    assert verdicts[1].startswith("failed: AssertionError: on altered input ")
    assert verdicts[2] == "passed"


def test_data_easy_draws_the_training_templates():
    """data "easy": max_examples problems of the training templates, none held out; one whose prompt has no room for
    an answer is left out and counted."""
    found, said = problems.easy_problems(30)
    assert len(found) == 30 and said == "30 of 30 easy problems from 12 templates"
    assert not {p["task_id"].split("/")[1] for p in found} & set(easy.HELD_OUT)
    vowels = lambda p: "too long" if "vowel" in p["prompt"] else ""  # noqa: E731
    kept, said = problems.easy_problems(30, vowels)
    left = 30 - len(kept)
    assert (
        0 < left < 30
        and said == f"{len(kept)} of 30 easy problems from 12 templates ({left} without room for an answer)"
    )


def test_the_learnable_band_keeps_problems_with_signal():
    """Of 8 answers each, problems passed 0, 3, 8, 1 and 7 times: the band is the three in between, 60% of groups."""
    found = [{"task_id": str(i)} for i in range(5)]
    kept, said = problems.band(found, [0, 3, 8, 1, 7], 8)
    assert [p["task_id"] for p in kept] == ["1", "3", "4"]
    counted = "(60% of groups with signal; 1 never, 1 always passed in 8 answers of the base model)"
    assert said == f"learnable band: 3 of 5 problems {counted}"


def test_the_problems_of_a_step_are_a_function_of_seed_and_step():
    """rl.py's steps take the problems in seeded permutations, one epoch after another: every problem once per epoch,
    the same for the same seed and step, another order for another seed."""
    epochs = [sum((problems.step_problems(5, 3, 7, s) for s in range(7 * e, 7 * e + 7)), []) for e in range(2)]
    assert [sorted(x[i : i + 7]) for x in epochs for i in (0, 7, 14)] == [list(range(7))] * 6
    assert problems.step_problems(5, 3, 7, 4) == [x for x in epochs[0][12:15]]
    assert epochs[0] != sum((problems.step_problems(6, 3, 7, s) for s in range(7)), [])


def test_learnable_samples_the_base_model_with_its_adapters_off(tiny_dir, tmp_path, monkeypatch):
    """learnable samples group_size answers to each problem from the model with its adapters off: of a problem every
    answer passes, one none passes and one whose test passes an even-length answer text, only the last is kept, and
    the same with adapters that change what is sampled. Where none is left, one line says so."""
    monkeypatch.setattr(humaneval, "completion", lambda text, chat: f"    return {text!r}\n")
    rows = [json.loads(line) for line in fixed_outcome_problems(tmp_path / "p.jsonl").read_text().splitlines()]
    even = dict(rows[0], task_id="even", test="def check(c):\n    assert len(c()) % 2 == 0\n")
    cfg = rl.RLConfig(group_size=8, sample_tokens=8, temperature=1.0)
    tok = Tokenizer(tiny_dir)
    model = load_model(tiny_dir, torch.float32, add_lora=dict(targets="all-linear", r=4, alpha=8, dropout=0.0))
    kept = problems.learnable(cfg, model, tok, [*rows, even], nullcontext)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 1.0, generator=torch.Generator().manual_seed(0))
    assert kept == [even] and problems.learnable(cfg, model, tok, [*rows, even], nullcontext) == kept
    with pytest.raises(ValueError, match=r"^learnable_only: learnable band: 0 of 2 problems .* no problem is left"):
        problems.learnable(cfg, model, tok, rows, nullcontext)
