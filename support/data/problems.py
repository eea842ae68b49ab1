"""What does rl.py train on? Problems whose tests decide, by running, whether an answer is right.

A problem has HumanEval's fields (support/evaluation/humaneval.py): `prompt`, `test` (defining check(candidate)),
`entry_point` and `task_id`; the sandbox runs prompt + completion in one process and the prompt and test, calling
the answer, in another, and the answer is right when check(entry_point) runs to the end. The offline set is the
standard library's doctested functions (docs/rl.md), each tested in its own module on all its examples, of which the
prompt shows half, and on altered inputs compared with the original; "easy" is support/data/easy.py's family of small
functions, drawn from templates; a user's JSONL file is checked before anything is written, one line naming each
mistake. A group of answers teaches only if their rewards differ, so `learnable` keeps the problems the base model
sometimes passes and sometimes fails.
"""

import ast
import doctest
import json
from pathlib import Path

import torch

import lora
from support.data import easy, examples
from support.evaluation import humaneval, sandbox

CHECK_TIMEOUT = 30.0  # seconds for a canonical solution: a busy machine must not change which problems are kept
STUB = "    raise NotImplementedError\n"  # an answer that answers nothing: a test it passes decides nothing
UNCROSSABLE = "failed: cannot cross"  # the verdict of an answer whose call cannot cross as data (sandbox.py)
EASY_PROBLEMS = 256  # data "easy" draws this many unless max_examples says
ALTERED_CALLS = 8  # of the calls the doctests made, how many are repeated on altered inputs (two each)
HEADER = """
DOCSTRING = {doc!r}
MODULE = {module!r}
CLASSES = {classes!r}
NAME = {name!r}
QUALNAME = {qualname!r}
ALTERED_CALLS = {altered}
"""
CHECK = '''

def check(candidate):
    import copy
    import doctest
    import importlib
    import random

    module = importlib.import_module(MODULE)
    owner = module
    for name in CLASSES:
        owner = getattr(owner, name)
    original = vars(owner)[NAME]
    # the classes of the module's namespace cross as their attributes (support/evaluation/codec.py)
    candidate.classes += [v for v in vars(module).values() if isinstance(v, type) and v.__module__ != "builtins"]
    seen = []

    def recording(*args, **kwargs):  # the answer, wherever the module calls the original; its calls kept
        try:
            seen.append(copy.deepcopy((args, kwargs)))
        except Exception:  # arguments that cannot be copied are not altered
            pass
        return candidate(*args, **kwargs)

    setattr(owner, NAME, recording)
    test = doctest.DocTestParser().get_doctest(DOCSTRING, dict(vars(module)), QUALNAME, None, 0)
    result = doctest.DocTestRunner(verbose=False).run(test, out=lambda text: None)
    assert result.failed == 0, f"{result.failed} of {result.attempted} doctest examples failed"
    rng = random.Random(QUALNAME)
    for args, kwargs in seen[:ALTERED_CALLS]:
        for _ in range(2):
            changed = (altered(args, rng), altered(kwargs, rng))
            if changed == (args, kwargs):
                continue
            setattr(owner, NAME, original)
            expected = [outcome(original, copy.deepcopy(changed)) for _ in range(2)]
            setattr(owner, NAME, recording)
            if not alike(*expected):  # the original does not answer the same twice: nothing to compare with
                continue
            got = outcome(candidate, copy.deepcopy(changed))
            assert alike(got, expected[0]), f"on altered input {changed!r}: {got!r}, expected {expected[0]!r}"


def outcome(function, call):
    args, kwargs = call
    try:
        return ("returned", function(*args, **kwargs))
    except Exception as e:
        return ("raised", type(e))


def alike(a, b) -> bool:
    """Both returned, or both raised, values of one type that are equal or (nan, objects compared by identity) equal
    in repr."""
    if a[0] != b[0] or type(a[1]) is not type(b[1]):
        return False
    try:
        return a[1] == b[1] or repr(a[1]) == repr(b[1])
    except Exception:
        return False


def altered(value, rng):
    """A copy of `value` with one small change where it holds a number, a string or a list: what the docstring's
    examples did not show."""
    kind = type(value)
    if kind is int:
        return value + rng.choice((-2, -1, 1, 2))
    if kind is float:
        return value * rng.choice((0.5, 1.5, -1.0)) + rng.choice((0.0, 0.25))
    if kind is str and value:
        i = rng.randrange(len(value))
        return value[:i] + rng.choice((value[i] * 2, "", value[-1 - i]))
    if kind in (list, tuple) and value:
        items = list(value)
        i = rng.randrange(len(items))
        items[i] = altered(items[i], rng)
        if kind is list and rng.random() < 0.3:  # a tuple is a call's arguments, or a record: its order stays
            rng.shuffle(items)
        return kind(items)
    if kind is dict and value:
        key = rng.choice(list(value))
        return value | {key: altered(value[key], rng)}
    return value
'''
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
        test = HEADER.format(doc=doc, qualname=qualname, altered=ALTERED_CALLS, **where) + CHECK
        prompt = f"# {module}.{qualname}, from Python's standard library\n{shown(head, doc)}"
        out.append(dict(task_id=f"stdlib/{module}.{qualname}", prompt=prompt, test=test, entry_point=node.name,
                        serve=SERVE.format(**where), canonical_solution=tail))  # fmt: skip
    return out


def shown(head: str, doc: str) -> str:
    """The signature and docstring with the second half of the docstring's examples taken out: the test still runs
    them all, so an answer that reproduces only what the prompt shows fails. `head` as it is when it has fewer than two
    examples, or when its example lines cannot be matched one to one with doctest's."""
    found = doctest.DocTestParser().get_examples(doc)
    lines = head.split("\n")
    starts = [i for i, line in enumerate(lines) if line.lstrip().startswith(">>>")]
    if len(found) < 2 or len(starts) != len(found):
        return head
    visible = (len(found) + 1) // 2
    hidden = zip(starts[visible:], found[visible:], strict=True)  # (first line, example) of those taken out
    cut = {j for i, example in hidden for j in range(i, i + example.source.count("\n") + example.want.count("\n"))}
    kept = "\n".join(line for i, line in enumerate(lines) if i not in cut)
    try:
        left = doctest.DocTestParser().get_examples(ast.get_docstring(ast.parse(kept).body[0]) or "")
    except (SyntaxError, IndexError, ValueError):
        return head
    same = [(e.source, e.want) for e in left] == [(e.source, e.want) for e in found[:visible]]
    return kept if same else head


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


def stdlib_problems(too_long=None, confine=True, limit=0, cache_dir=None) -> tuple[list[dict], str]:
    """The standard library's doctested functions whose tests decide, the shortest canonical solution first (so that
    max_examples keeps the easiest), and a line counting those left out and why; too_long(problem) -> str, when
    given, leaves out the problems whose prompt leaves no room for an answer (it says why, "" if not). With `limit`,
    the first `limit` of them: candidates are judged in that order, a few more at a time than are still wanted, until
    enough are kept (judging all ~280, two sandboxed programs each, took about 45 s of rl.py's start on 2 cores).
    The candidates are kept in cache_dir (examples.stdlib_cached)."""
    candidates = examples.stdlib_cached(stdlib_candidates, cache_dir)
    fit = [p for p in candidates if too_long is None or not too_long(p)]
    fit.sort(key=lambda p: (len(p["canonical_solution"]), p["task_id"]))
    kept, reasons = [], []
    while len(reasons) < len(fit) and not (limit and len(kept) >= limit):
        batch = fit[len(reasons) :][: max(16, 2 * (limit - len(kept))) if limit else None]
        reasons += left_out(batch, confine)
        kept = [p for p, r in zip(fit, reasons, strict=False) if not r]
    kept = kept[: limit or None]
    said = {"cannot cross": "whose calls cannot cross as data", "does not decide": "whose test does not decide"}
    counts = [f"{reasons.count(r)} {words}" for r, words in said.items() if r in reasons]
    counts += [f"{len(candidates) - len(fit)} without room for an answer"] if len(fit) < len(candidates) else []
    judged = f", the first {len(reasons)} judged" if len(reasons) < len(fit) else ""
    left = ", ".join(counts) or "none left out"
    return kept, f"{len(kept)} of {len(candidates)} doctested stdlib functions{judged} ({left})"


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
    room for an answer: the stdlib's (those without are left out), the easy family's or the data file's (a prompt
    without is an error naming its line); confined by the kernel unless eval_task_unconfined. With them, the line
    that reports them."""
    too_long = room(tok, cfg.template or None, cfg.sample_tokens, cfg.context_length)
    confine = not cfg.eval_task_unconfined
    if cfg.data == "easy":
        found, said = easy_problems(cfg.max_examples or EASY_PROBLEMS, too_long)
    elif cfg.data:
        found, said = read_problems(cfg.data, too_long, confine)
    else:
        found, said = stdlib_problems(too_long, confine, cfg.max_examples, cfg.cache_dir)
    if not found:
        raise ValueError(f"data: no problem fits context_length {cfg.context_length} with sample_tokens")
    if cfg.max_examples and cfg.max_examples < len(found):
        said += f"; the first {cfg.max_examples} (max_examples)"
    return found[: cfg.max_examples or None], said


def step_problems(seed: int, per_step: int, n: int, step: int) -> list[int]:
    """The per_step problems (indices of the n) of step `step`: seeded permutations of the n, one epoch after another,
    a function of (seed, step) alone, so that a resumed run takes up the same order."""
    places = range(step * per_step, (step + 1) * per_step)  # in the run's sequence of epochs
    return [int(torch.randperm(n, generator=torch.Generator().manual_seed(seed + k // n))[k % n]) for k in places]


def easy_problems(n, too_long=None) -> tuple[list[dict], str]:
    """n problems of support/data/easy.py's training templates, and the line that reports them; those whose prompt
    leaves no room for an answer (too_long(problem) says why) are left out."""
    drawn = easy.easy_problems(n)
    kept = [p for p in drawn if too_long is None or not too_long(p)]
    room = f" ({len(drawn) - len(kept)} without room for an answer)" if len(kept) < n else ""
    return kept, f"{len(kept)} of {n} easy problems from {len(easy.TEMPLATES) - len(easy.HELD_OUT)} templates{room}"


def learnable(cfg, model, tok, problems, autocast) -> list[dict]:
    """The problems in the learnable band: of group_size answers the base model (`model` with its adapters off)
    samples to each, as rl.py's rollout does, some pass and some fail. The line that reports the band is printed."""
    sampled = dict(sampling=(cfg.temperature, cfg.top_p), seed=cfg.seed)
    args = (cfg.group_size, cfg.template or None, autocast, cfg.sample_tokens, not cfg.eval_task_unconfined)
    with lora.adapters_off(model):  # the base: the same band when a run resumes
        passes = humaneval.pass_counts(model, tok, problems, *args, **sampled)
    kept, said = band(problems, passes, cfg.group_size)
    if not kept:
        raise ValueError(f"learnable_only: {said}; no problem is left to learn from")
    print(said)
    return kept


def band(problems, passes, samples) -> tuple[list[dict], str]:
    """The problems whose `passes` of `samples` answers are above 0 and below samples, and the line that reports them:
    the share of groups with signal before any training."""
    kept = [p for p, n in zip(problems, passes, strict=True) if 0 < n < samples]
    never = sum(n == 0 for n in passes)
    always = sum(n == samples for n in passes)
    share = f"{100 * len(kept) / len(problems):.0f}% of groups with signal"
    said = f"learnable band: {len(kept)} of {len(problems)} problems ({share}; {never} never, {always} always passed"
    return kept, f"{said} in {samples} answers of the base model)"
