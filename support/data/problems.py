"""What does rl.py train on? Problems whose tests decide, by running, whether an answer is right.

A problem has HumanEval's fields (support/evaluation/humaneval.py): `prompt`, `test` (defining check(candidate)),
`entry_point` and `task_id`; prompt + completion + test + check(entry_point) runs in the sandbox, and the answer is
right when it runs to the end. The offline set is the standard library's doctested functions (docs/rl.md), each tested
in its own module; a user's JSONL file is checked before anything is written, one line naming each mistake.
"""

import ast
import json
from pathlib import Path

from support.data import examples
from support.evaluation import humaneval, sandbox

CHECK_TIMEOUT = 30.0  # seconds for a canonical solution: a busy machine must not change which problems are kept
STUB = "    raise NotImplementedError\n"  # an answer that answers nothing: a test it passes decides nothing
TEST = """
DOCSTRING = {doc!r}


def check(candidate):
    import doctest
    import importlib
    import types

    module = importlib.import_module({module!r})
    owner = module
    for name in {classes!r}:
        owner = getattr(owner, name)
    # the answer's code with its module's globals, where the original was
    function = types.FunctionType(
        candidate.__code__, vars(module), {name!r}, candidate.__defaults__, candidate.__closure__
    )
    function.__kwdefaults__ = candidate.__kwdefaults__
    setattr(owner, {name!r}, function)
    test = doctest.DocTestParser().get_doctest(DOCSTRING, dict(vars(module)), {qualname!r}, None, 0)
    result = doctest.DocTestRunner(verbose=False).run(test, out=lambda text: None)
    assert result.failed == 0, f"{{result.failed}} of {{result.attempted}} doctest examples failed"
"""


def doctested(body, lines, module, classes=()) -> list[dict]:
    """The problems of the undecorated functions and methods among `body`'s statements (classes searched, nested
    functions not) whose docstrings hold a doctest (">>>"), each with its own body as canonical_solution."""
    out = []
    for node in body:
        if isinstance(node, ast.ClassDef):
            out += doctested(node.body, lines, module, (*classes, node.name))
        # decorated: a staticmethod or a property put back as a plain function would change
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.decorator_list:
            continue
        doc = ast.get_docstring(node)
        if not doc or ">>>" not in doc or len(node.body) < 2 or node.body[0].end_lineno >= node.body[1].lineno:
            continue  # no doctest, no code besides the docstring, or code on the docstring's line
        if (parts := examples.function_parts(node, lines)) is None:
            continue
        head, tail = (part + "\n" for part in parts)
        qualname = ".".join((*classes, node.name))
        test = TEST.format(doc=doc, module=module, classes=list(classes), name=node.name, qualname=qualname)
        prompt = f"# {module}.{qualname}, from Python's standard library\n{head}"
        out.append(dict(task_id=f"stdlib/{module}.{qualname}", prompt=prompt, test=test, entry_point=node.name,
                        canonical_solution=tail))  # fmt: skip
    return out


def stdlib_candidates() -> list[dict]:
    """Every doctested function and method of this Python's standard library, before its test is run."""
    out = []
    for rel, lines, tree in examples.stdlib_files():
        parts = rel.with_suffix("").parts  # json/decoder.py -> json.decoder, json/__init__.py -> json
        if rel.name != "__main__.py":
            out += doctested(tree.body, lines, ".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def decisive(problems, confine=True) -> list[bool]:
    """Whether each problem's test tells answers apart: its canonical_solution passes and a body that only raises
    fails (a doctest marked +SKIP, or one that never calls the function, passes anything). Run in the sandbox."""
    programs = [humaneval.program(p, answer) for p in problems for answer in (p["canonical_solution"], STUB)]
    verdicts = sandbox.run_many(programs, CHECK_TIMEOUT, confine=confine)
    return [right == "passed" and stub != "passed" for right, stub in zip(verdicts[::2], verdicts[1::2], strict=True)]


def stdlib_problems(too_long=None, confine=True) -> list[dict]:
    """The standard library's doctested functions whose tests are decisive, the shortest canonical solution first (so
    that max_examples keeps the easiest); too_long(problem) -> str, when given, leaves out the problems whose prompt
    leaves no room for an answer (it says why, "" if not)."""
    candidates = [p for p in stdlib_candidates() if too_long is None or not too_long(p)]
    kept = [p for p, ok in zip(candidates, decisive(candidates, confine), strict=True) if ok]
    return sorted(kept, key=lambda p: (len(p["canonical_solution"]), p["task_id"]))


def room(tok, template, sample_tokens, context_length):
    """too_long(problem) -> str: why a problem's prompt, as humaneval.prompt_ids puts it, leaves no room for an answer
    of sample_tokens within context_length ("auto": any), or "" when it does."""

    def too_long(problem) -> str:
        n = len(humaneval.prompt_ids(problem, tok, template))
        if context_length == "auto" or n + sample_tokens <= context_length:
            return ""
        return f"prompt of {n} tokens + sample_tokens {sample_tokens} exceeds context_length {context_length}"

    return too_long


def read_problems(path, too_long=None, confine=True) -> list[dict]:
    """A user's JSONL file of problems, checked (docs/rl.md lists the checks), each mistake one ValueError line naming
    the file and line; too_long(problem) -> str says why a prompt leaves no room for an answer ("" when it does)."""
    problems = humaneval.load_problems(path)  # the four fields, JSON, unique task ids: one line per mistake
    text = Path(path).read_text(encoding="utf-8").splitlines()
    numbers = [n for n, line in enumerate(text, 1) if line.strip()]  # load_problems skips blank lines
    rows = [json.loads(text[n - 1]) for n in numbers]
    for n, row in zip(numbers, rows, strict=True):
        if "canonical_solution" in row and not isinstance(row["canonical_solution"], str):
            raise ValueError(f"{path}:{n}: canonical_solution must be a string (the code completing the prompt)")
    for n, problem in zip(numbers, problems, strict=True):
        if too_long is not None and (why := too_long(problem)):
            raise ValueError(f"{path}:{n}: {why}")
    solved = [(n, humaneval.program(p, r["canonical_solution"]))
              for n, p, r in zip(numbers, problems, rows, strict=True) if "canonical_solution" in r]  # fmt: skip
    verdicts = sandbox.run_many([program for _, program in solved], CHECK_TIMEOUT, confine=confine)
    for (n, _), verdict in zip(solved, verdicts, strict=True):
        if verdict != "passed":
            raise ValueError(f"{path}:{n}: canonical_solution does not pass its test ({verdict})")
    return problems


def training_problems(cfg, tok) -> list[dict]:
    """rl.py's problems (an rl.RLConfig's data, max_examples, sample_tokens, context_length, template), each with
    room for an answer: the stdlib's (those without are left out) or the data file's (a prompt without is an error
    naming its line); confined by the kernel unless eval_task_unconfined."""
    too_long = room(tok, cfg.template or None, cfg.sample_tokens, cfg.context_length)
    confine = not cfg.eval_task_unconfined
    found = read_problems(cfg.data, too_long, confine) if cfg.data else stdlib_problems(too_long, confine)
    if not found:
        raise ValueError(f"data: no problem fits context_length {cfg.context_length} with sample_tokens")
    return found[: cfg.max_examples or None]
