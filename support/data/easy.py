"""What can a small model learn from by reinforcement, offline? Easy functions made from templates, tested on inputs
no prompt shows.

A template is one small task (the sum of a list, the vowels of a word, x * k + c, ...) with a few names for the
function and its arguments, a few wordings, constants, a reference expression and a generator of inputs. A problem
draws all of these from a seeded generator. Its prompt is the signature and a docstring with one worked example; its
test, which only the judge runs (support/evaluation/sandbox.py), calls the answer on TESTS random inputs drawn there and
compares each result with the reference's. Whole templates are held out (HELD_OUT): a model that improves on them has
learned to write the functions, not these prompts' answers.
"""

import random
from typing import NamedTuple

TESTS = 20  # random inputs a test checks
INTS = "[rng.randint(-20, 20) for _ in range(rng.randint(0, 7))]"
SOME_INTS = "[rng.randint(-20, 20) for _ in range(rng.randint(1, 7))]"
INT = "rng.randint(-50, 50)"
WORD = "''.join(rng.choice('abcdeiopstu') for _ in range(rng.randint(0, 9)))"
WORDS = "[''.join(rng.choice('abcdeiopstu') for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(0, 5))]"
SENTENCE = f"' '.join({WORDS})"
LISTS = ("numbers", "values", "nums", "xs", "items", "data")
TEXTS = ("s", "text", "word", "string")


class Template(NamedTuple):
    """One task: `args` (name choices, type, input generator) per argument; `expr` the reference, in terms of {a}, {b}
    (the arguments' names) and constants {k}, {c} drawn from `constants`; `words` the docstring's first line."""

    task: str
    names: tuple
    args: tuple  # ((names, type, generator), ...)
    returns: str
    expr: str
    words: tuple
    constants: tuple = ()  # ((name, choices), ...)


def ints(names=LISTS, generator=INTS):
    return ((names, "list[int]", generator),)


TEMPLATES = (
    Template("sum", ("total", "sum_list", "add_all"), ints(), "int", "sum({a})",
             ("Return the sum of the numbers in {a}.", "Add up all the integers in {a} and return the total.")),
    Template("vowels", ("count_vowels", "vowel_count"), ((TEXTS, "str", WORD),), "int",
             "sum(ch in 'aeiou' for ch in {a})",
             ("Return how many vowels (a, e, i, o, u) are in {a}.", "Count the vowels a, e, i, o and u in {a}.")),
    Template("linear", ("scale", "transform", "apply"), ((("x", "n", "value"), "int", INT),), "int", "{a} * {k} + {c}",
             ("Return {a} times {k} plus {c}.", "Multiply {a} by {k}, add {c} and return the result."),
             (("k", range(2, 10)), ("c", range(-9, 10)))),
    Template("reverse", ("reverse", "reversed_text", "backwards"), ((TEXTS, "str", WORD),), "str", "{a}[::-1]",
             ("Return {a} reversed.", "Return the characters of {a} in reverse order.")),
    Template("largest", ("largest", "biggest", "maximum"), ints(generator=SOME_INTS), "int", "max({a})",
             ("Return the largest number in {a} (it is not empty).", "Find the biggest integer in the non-empty {a}.")),
    Template("evens", ("evens", "keep_even", "only_even"), ints(), "list[int]", "[x for x in {a} if x % 2 == 0]",
             ("Return the even numbers of {a}, in order.", "Keep only the even integers of {a}, in their order.")),
    Template("squares", ("squares", "square_all"), ints(), "list[int]", "[x * x for x in {a}]",
             ("Return the square of each number in {a}.", "Return a list of every integer in {a} squared.")),
    Template("palindrome", ("is_palindrome", "reads_same"), ((TEXTS, "str", WORD),), "bool", "{a} == {a}[::-1]",
             ("Return True if {a} reads the same backwards, else False.", "Whether {a} is a palindrome.")),
    Template("positives", ("count_positive", "positives"), ints(), "int", "sum(1 for x in {a} if x > 0)",
             ("Return how many numbers in {a} are greater than zero.", "Count the positive integers in {a}.")),
    Template("shift", ("add_to_each", "shift_all"), ints(), "list[int]", "[x + {k} for x in {a}]",
             ("Return a list of each number in {a} plus {k}.", "Add {k} to every integer of {a}."),
             (("k", range(1, 10)),)),
    Template("count", ("count_char", "occurrences"), ((TEXTS, "str", WORD), (("ch", "c", "letter"), "str",
             "rng.choice('aeiost')")), "int", "{a}.count({b})",
             ("Return how many times {b} occurs in {a}.", "Count the occurrences of the character {b} in {a}.")),
    Template("join", ("join_words", "glue"), ((("words", "parts"), "list[str]", WORDS),), "str",
             "'{sep}'.join({a})", ("Join the strings of {a} with '{sep}' between them.",),
             (("sep", (", ", "-", " ")),)),
    # held out
    Template("smallest", ("smallest", "minimum", "least"), ints(generator=SOME_INTS), "int", "min({a})",
             ("Return the smallest number in {a} (it is not empty).", "Find the least integer in the non-empty {a}.")),
    Template("words", ("count_words", "word_count"), ((TEXTS, "str", SENTENCE),), "int", "len({a}.split())",
             ("Return how many words separated by spaces are in {a}.", "Count the space-separated words of {a}.")),
    Template("odds", ("odds", "keep_odd"), ints(), "list[int]", "[x for x in {a} if x % 2 != 0]",
             ("Return the odd numbers of {a}, in order.", "Keep only the odd integers of {a}, in their order.")),
    Template("double", ("double_all", "twice"), ints(), "list[int]", "[2 * x for x in {a}]",
             ("Return each number of {a} doubled.", "Return a list of every integer in {a} times two.")),
)  # fmt: skip
HELD_OUT = ("smallest", "words", "odds", "double")


def problem(template: Template, rng: random.Random, index: int) -> dict:
    """One problem of `template`: names, wording and constants drawn from `rng`, a worked example in its docstring."""
    names = [rng.choice(names) for names, _, _ in template.args]
    fields = dict(zip("ab", names, strict=False))
    fields |= {key: rng.choice(choices) for key, choices in template.constants}
    expr = template.expr.format(**fields)
    entry = rng.choice(template.names)
    inputs = "(" + "".join(f"{generator}, " for _, _, generator in template.args) + ")"
    example = eval(inputs, {"rng": rng})  # the module's own generator strings
    reference = eval(f"lambda {', '.join(names)}: {expr}")
    shown = f">>> {entry}({', '.join(repr(x) for x in example)})\n    {reference(*example)!r}"
    signature = ", ".join(f"{n}: {t}" for n, (_, t, _) in zip(names, template.args, strict=True))
    words = rng.choice(template.words).format(**fields)
    prompt = f'def {entry}({signature}) -> {template.returns}:\n    """{words}\n\n    {shown}\n    """\n'
    test = TEST.format(seed=rng.randrange(2**32), n=TESTS, inputs=inputs, params=", ".join(names), expr=expr)
    task_id = f"easy/{template.task}/{index}"
    return dict(task_id=task_id, prompt=prompt, test=test, entry_point=entry, canonical_solution=f"    return {expr}\n")


TEST = """
def check(candidate):
    import copy
    import random

    rng = random.Random({seed})
    reference = lambda {params}: {expr}
    for _ in range({n}):
        args = {inputs}
        expected = reference(*copy.deepcopy(args))
        assert candidate(*args) == expected, f"{{args}}: expected {{expected!r}}"
"""


def easy_problems(n: int, held_out: bool = False, seed: int = 0) -> list[dict]:
    """`n` problems drawn in turn from the templates used for training, or from the HELD_OUT ones."""
    rng = random.Random(f"easy-{seed}-{held_out}")
    templates = [t for t in TEMPLATES if (t.task in HELD_OUT) == held_out]
    return [problem(templates[i % len(templates)], rng, i) for i in range(n)]
