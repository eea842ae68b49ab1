"""support/data/easy.py: problems made from templates, tested on inputs no prompt shows.

Proves: the same seed draws the same problems and another seed others; the held-out templates never appear among the
training problems; every problem's prompt is a function with a docstring whose worked example is what its reference
returns; judged in the sandbox, every canonical solution passes and a wrong answer fails, and an answer that returns
the prompt's worked example whatever it is given (a lookup table of what the prompt shows) fails too.
"""

import ast

from support.data import easy
from support.evaluation import humaneval, sandbox

WHY = sandbox.confinement()


def test_problems_are_seeded_and_templates_held_out():
    """Two draws with one seed are equal, with another seed they differ; the training problems use every template but
    the HELD_OUT ones, and the held-out problems only those."""
    train = easy.easy_problems(32, seed=1)
    assert train == easy.easy_problems(32, seed=1) and train != easy.easy_problems(32, seed=2)
    tasks = {p["task_id"].split("/")[1] for p in train}
    held = {p["task_id"].split("/")[1] for p in easy.easy_problems(8, held_out=True, seed=1)}
    assert held == set(easy.HELD_OUT) and tasks == {t.task for t in easy.TEMPLATES} - held


def test_the_prompts_worked_example_is_the_references():
    """Each prompt parses as one function with a docstring; its doctest example, run against the canonical
    solution, prints what the docstring says."""
    import doctest

    for p in easy.easy_problems(16) + easy.easy_problems(4, held_out=True):
        tree = ast.parse(p["prompt"])
        assert len(tree.body) == 1 and ast.get_docstring(tree.body[0]).count(">>>") == 1
        names: dict = {}
        exec(p["prompt"] + p["canonical_solution"], names)
        test = doctest.DocTestParser().get_doctest(ast.get_docstring(tree.body[0]), names, p["entry_point"], None, 0)
        assert doctest.DocTestRunner().run(test, out=lambda text: None).failed == 0, p["prompt"]


def test_hidden_inputs_decide():
    """In the sandbox: the canonical solutions pass; answers that return None, or the prompt's worked example's
    result whatever the input, fail."""
    problems = easy.easy_problems(12) + easy.easy_problems(4, held_out=True)
    answers = [humaneval.answer(p, p["canonical_solution"]) for p in problems]
    answers += [humaneval.answer(p, "    return None\n") for p in problems]
    for p in problems:
        shown = p["prompt"].split(">>> ")[1].split("\n")[1].strip()  # the example's printed result
        answers.append(humaneval.answer(p, f"    return {shown}\n"))
    verdicts = sandbox.run_many(answers, confine=not WHY)
    n = len(problems)
    assert verdicts[:n] == ["passed"] * n
    assert "passed" not in verdicts[n:]
