"""generate.py: try a model, or a fine-tuned adapter on its base, from the command line.

    python generate.py "Write a Python function that reverses a string."
    python generate.py --adapter out/adapter --quantize "def parse_header(line):"
    python generate.py --model checkpoints/Llama-3.1-8B --temperature 0.7 --top_p 0.9 "..."

The prompt goes through the checkpoint's chat template when it has one (a single user turn plus the assistant
header), else it is used as it is. Decoding is greedy at temperature 0, else temperature + nucleus sampling, through
the KV cache (support/sampling.py). With --adapter the base is built as in training (NF4 with --quantize) and the
PEFT-format adapter is applied on top, so what you see is what the adapter does, not a merged approximation.
"""

import argparse
import os

import torch

from support import atomic, gguf_read
from support.sampling import generate
from support.tokenizer import Tokenizer
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
    p.add_argument("prompt")
    p.add_argument("--model", default="", help="HF-format directory (default: the adapter's base, else SmolLM2)")
    p.add_argument("--adapter", default="", help="PEFT-format adapter directory to apply")
    p.add_argument("--quantize", action="store_true", help="NF4 base weights, as in QLoRA training")
    p.add_argument("--max_new_tokens", type=int, default=200)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    try:
        model_dir = model_dir_for(args.model, args.adapter)
        tok = Tokenizer(model_dir)
        model = load_model(model_dir, torch.float32, quantize=args.quantize, adapter=args.adapter).eval()
    except (ValueError, OSError, ImportError) as e:  # a bad directory or adapter: one line, as train.py says it
        raise SystemExit(f"error: {e}") from None
    ids = chat_prompt(tok, args.prompt)
    out = generate(model, ids, args.max_new_tokens, args.temperature, args.top_p, eos_id=tok.eos_id, seed=args.seed)
    print(tok.decode([i for i in out if i != tok.eos_id]))


if __name__ == "__main__":
    main()
