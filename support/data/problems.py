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
UNCROSSABLE = "failed: cannot cross"  # the verdict of an answer whose call cannot cross as data (sandbox.py)
TEST = """
DOCSTRING = {doc!r}


def check(candidate):
    import doctest
    import importlib

    module = importlib.import_module({module!r})
    owner = module
    for name in {classes!r}:
        owner = getattr(owner, name)
    # the classes of the module's namespace cross as their attributes (support/evaluation/codec.py)
    candidate.classes += [v for v in vars(module).values() if isinstance(v, type) and v.__module__ != "builtins"]
    setattr(owner, {name!r}, candidate)  # the answer, wherever the module calls the original
    test = doctest.DocTestParser().get_doctest(DOCSTRING, dict(vars(module)), {qualname!r}, None, 0)
    result = doctest.DocTestRunner(verbose=False).run(test, out=lambda text: None)
    assert result.failed == 0, f"{{result.failed}} of {{result.attempted}} doctest examples failed"
"""
SERVE = """
def _install():
    import importlib
    import types

    module = importlib.import_module({module!r})
    owner = module
    for name in {classes!r}:
        owner = getattr(owner, name)
    # the answer's code with its module's globals, where the original was
    answer = globals()[{name!r}]
    function = types.FunctionType(answer.__code__, vars(module), {name!r}, answer.__defaults__, answer.__closure__)
    function.__kwdefaults__ = answer.__kwdefaults__
    setattr(owner, {name!r}, function)
    globals()[{name!r}] = function


_install()
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
        where = dict(module=module, classes=list(classes), name=node.name)
        test = TEST.format(doc=doc, qualname=qualname, **where)
        prompt = f"# {module}.{qualname}, from Python's standard library\n{head}"
        out.append(dict(task_id=f"stdlib/{module}.{qualname}", prompt=prompt, test=test, entry_point=node.name,
                        serve=SERVE.format(**where), canonical_solution=tail))  # fmt: skip
    return out


def stdlib_candidates() -> list[dict]:
    """Every doctested function and method of this Python's standard library, before its test is run."""
    out = []
    for rel, lines, tree in examples.stdlib_files():
        parts = rel.with_suffix("").parts  # json/decoder.py -> json.decoder, json/__init__.py -> json
        if rel.name != "__main__.py":
            out += doctested(tree.body, lines, ".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return out


def left_out(problems, confine=True) -> list[str]:
    """Why each problem is left out, "" when it is kept: its canonical solution cannot cross between the answer's
    process and the judge's (an argument or a value that is not data, support/evaluation/calls.py), or its test does
    not decide: the canonical solution fails, or a body that only raises passes (a doctest marked +SKIP, or one that
    never calls the function). Judged in the sandbox."""
    answers = [humaneval.answer(p, answer) for p in problems for answer in (p["canonical_solution"], STUB)]
    verdicts = sandbox.run_many(answers, CHECK_TIMEOUT, confine=confine)
    return [why(right, stub) for right, stub in zip(verdicts[::2], verdicts[1::2], strict=True)]


def why(right: str, stub: str) -> str:
    if right.startswith(UNCROSSABLE):
        return "cannot cross"
    return "" if right == "passed" and stub != "passed" else "does not decide"


def stdlib_problems(too_long=None, confine=True) -> tuple[list[dict], str]:
    """The standard library's doctested functions whose tests decide, the shortest canonical solution first (so that
    max_examples keeps the easiest), and a line counting those left out and why; too_long(problem) -> str, when
    given, leaves out the problems whose prompt leaves no room for an answer (it says why, "" if not)."""
    candidates = stdlib_candidates()
    fit = [p for p in candidates if too_long is None or not too_long(p)]
    reasons = left_out(fit, confine)
    kept = sorted(
        (p for p, r in zip(fit, reasons, strict=True) if not r),
        key=lambda p: (len(p["canonical_solution"]), p["task_id"]),
    )
    said = {"cannot cross": "whose calls cannot cross as data", "does not decide": "whose test does not decide"}
    counts = [f"{reasons.count(r)} {words}" for r, words in said.items() if r in reasons]
    counts += [f"{len(candidates) - len(fit)} without room for an answer"] if len(fit) < len(candidates) else []
    return kept, f"{len(kept)} of {len(candidates)} doctested stdlib functions ({', '.join(counts) or 'none left out'})"


def room(tok, template, sample_tokens, context_length):
    """too_long(problem) -> str: why a problem's prompt, as humaneval.prompt_ids puts it, leaves no room for an answer
    of sample_tokens within context_length ("auto": any), or "" when it does."""

    def too_long(problem) -> str:
        n = len(humaneval.prompt_ids(problem, tok, template))
        if context_length == "auto" or n + sample_tokens <= context_length:
            return ""
        return f"prompt of {n} tokens + sample_tokens {sample_tokens} exceeds context_length {context_length}"

    return too_long


def read_problems(path, too_long=None, confine=True) -> tuple[list[dict], str]:
    """A user's JSONL file of problems, checked (docs/rl.md lists the checks), each mistake one ValueError line naming
    the file and line, and a line counting them; too_long(problem) -> str says why a prompt leaves no room for an
    answer ("" when it does). A problem whose canonical_solution cannot cross as data is left out and counted."""
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
    solved = [i for i, row in enumerate(rows) if "canonical_solution" in row]
    answers = [humaneval.answer(problems[i], rows[i]["canonical_solution"]) for i in solved]
    verdicts = sandbox.run_many(answers, CHECK_TIMEOUT, confine=confine)
    for i, verdict in zip(solved, verdicts, strict=True):
        if verdict != "passed" and not verdict.startswith(UNCROSSABLE):
            raise ValueError(f"{path}:{numbers[i]}: canonical_solution does not pass its test ({verdict})")
    crossing = {i for i, verdict in zip(solved, verdicts, strict=True) if verdict.startswith(UNCROSSABLE)}
    kept = [p for i, p in enumerate(problems) if i not in crossing]
    return kept, f"{len(kept)} of {len(problems)} problems in {path} ({len(crossing)} cannot cross)"


def training_problems(cfg, tok) -> tuple[list[dict], str]:
    """rl.py's problems (an rl.RLConfig's data, max_examples, sample_tokens, context_length, template), each with
    room for an answer: the stdlib's (those without are left out) or the data file's (a prompt without is an error
    naming its line); confined by the kernel unless eval_task_unconfined. With them, the line that reports them."""
    too_long = room(tok, cfg.template or None, cfg.sample_tokens, cfg.context_length)
    confine = not cfg.eval_task_unconfined
    found, said = read_problems(cfg.data, too_long, confine) if cfg.data else stdlib_problems(too_long, confine)
    if not found:
        raise ValueError(f"data: no problem fits context_length {cfg.context_length} with sample_tokens")
    if cfg.max_examples and cfg.max_examples < len(found):
        said += f"; the first {cfg.max_examples} (max_examples)"
    return found[: cfg.max_examples or None], said
