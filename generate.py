"""generate.py: try a model, or a fine-tuned adapter on its base, from the command line.

    python generate.py "Write a Python function that reverses a string."
    python generate.py --adapter out/adapter --quantize "def parse_header(line):"
    python generate.py --model checkpoints/Llama-3.1-8B --temperature 0.7 --top_p 0.9 "..."
    python generate.py --adapter out/adapter --quantize --eval_task humaneval    # pass@1 of the adapter on its base

The prompt goes through the checkpoint's chat template when it has one (a single user turn plus the assistant header),
else it is used as it is. Decoding is greedy at temperature 0, else temperature + nucleus sampling, through the KV cache
(support/evaluation/sampling.py). With --adapter the base is built as in training (NF4 with --quantize) and the
PEFT-format adapter is applied on top, so what you see is what the adapter does, not a merged approximation. --eval_task
scores the model (an adapter on its base, or a merged model given as --model) instead of answering a prompt: greedy
pass@1 on HumanEval or a JSONL file of problems, as train.py's eval_task does (support/evaluation/humaneval.py).
"""

import argparse
import os

import support.run.threads  # noqa: F401 (before torch: how idle threads wait, support/run/threads.py)

# isort: split
import torch

from support.data.tokenizer import Tokenizer
from support.evaluation import humaneval, sandbox
from support.evaluation.sampling import generate_batch
from support.formats import atomic, gguf_read
from train import load_model


def chat_prompt(tok, text):
    if tok.chat_template is None:
        return tok.encode(text, bos=tok.add_bos)
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True))


def model_dir_for(model, adapter):
    """The base model's directory: --model; else the adapter's own base (its base_model_name_or_path, when that is a
    model directory here); else the converted SmolLM2."""
    if model or not adapter:
        return model or gguf_read.smollm2_dir()
    base = atomic.read_json(os.path.join(adapter, "adapter_config.json")).get("base_model_name_or_path") or ""
    return base if base and os.path.isfile(os.path.join(base, "config.json")) else gguf_read.smollm2_dir()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("prompt", nargs="?", default="", help="what to answer (not with --eval_task)")
    p.add_argument("--model", default="", help="HF-format directory (default: the adapter's base, else SmolLM2)")
    p.add_argument("--adapter", default="", help="PEFT-format adapter directory to apply")
    p.add_argument("--quantize", action="store_true", help="NF4 base weights, as in QLoRA training")
    p.add_argument("--max_new_tokens", type=int, default=0, help="default 200 (with --eval_task 384)")
    p.add_argument("--eval_task", default="", help="'humaneval' or a JSONL file of problems: print pass@1 instead")
    p.add_argument("--eval_task_problems", type=int, default=0, help="only the first N problems (default all)")
    p.add_argument("--eval_task_unconfined", action="store_true", help="run the answers under the Python guards alone")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    if bool(args.prompt) == bool(args.eval_task):
        p.error("give a prompt or --eval_task, one of the two")
    if args.eval_task and not args.eval_task_unconfined and (why := sandbox.confinement()):
        raise SystemExit(f"error: eval_task: the kernel cannot confine the model's code ({why}); "
                         "--eval_task_unconfined runs it under the Python guards alone")  # fmt: skip
    try:
        problems = humaneval.load_problems(args.eval_task)[: args.eval_task_problems or None] if args.eval_task else []
        model_dir = model_dir_for(args.model, args.adapter)
        tok = Tokenizer(model_dir)
        model = load_model(model_dir, torch.float32, quantize=args.quantize, adapter=args.adapter).eval()
    except (ValueError, OSError, ImportError) as e:  # a bad directory or adapter: one line, as train.py says it
        raise SystemExit(f"error: {e}") from None
    if problems:  # greedy answers, scored sandboxed: "HumanEval pass@1: 12.2% (20/164 problems)"
        tokens = args.max_new_tokens or humaneval.MAX_NEW_TOKENS
        result = humaneval.evaluate(model, tok, problems, max_new_tokens=tokens, confine=not args.eval_task_unconfined)
        counts = f"{result['passed']}/{result['problems']} problems"
        return print(f"{humaneval.label(args.eval_task)} pass@1: {100 * result['pass@1']:.1f}% ({counts})")
    ids = chat_prompt(tok, args.prompt)
    tokens = args.max_new_tokens or 200
    sampling = dict(temperature=args.temperature, top_p=args.top_p, seed=args.seed)
    out = generate_batch(model, [ids], tokens, eos_id=tok.eos_id, **sampling)[0]
    print(humaneval.text(tok, out))  # stop tokens dropped, one eos id or several


if __name__ == "__main__":
    main()
