"""How long do tokenizing and packing a Magicoder-sized dataset take, and reading it back from the token cache?

    python bench.py pack               tokenize + pack 75,000 Magicoder-sized examples, then again from the cache

The data is written once to out/bench (problem -> solution pairs cut from stdlib code and docstrings); both builds go
through pack.build_dataset with the SmolLM2 chat template, the second one a cache hit (support/token_cache.py).
"""

import json
import os
import tempfile
import time
from pathlib import Path

from benchmarks.common import OUT_DIR
from pack import build_dataset
from support import atomic
from support.examples import stdlib_examples
from support.preview import packing_report
from support.tokenizer import Tokenizer


def bench_pack(n=75_000, context=2048):
    """A Magicoder-OSS-Instruct-sized JSONL (problem -> solution pairs cut from stdlib code and docstrings), tokenized
    and packed with the SmolLM2 chat template, then built a second time from the token cache."""
    from support import gguf_read

    path = os.path.join(OUT_DIR, f"magicoder{n // 1000}k.jsonl")
    if not os.path.exists(path):
        examples = stdlib_examples("train")
        os.makedirs(OUT_DIR, exist_ok=True)
        lines = []
        for i in range(n):  # Magicoder's problems and solutions run to a few hundred tokens each
            a, b = examples[i % len(examples)], examples[(7 * i + 1) % len(examples)]
            row = {"problem": f"{i}: " + a["instruction"], "solution": a["response"] + b["response"]}
            lines.append(json.dumps(row) + "\n")
        atomic.atomic_write(path, lambda tmp: Path(tmp).write_text("".join(lines)))
    tok = Tokenizer(gguf_read.smollm2_dir())
    with tempfile.TemporaryDirectory(dir=OUT_DIR) as cache:
        for label in ("first run (tokenize + pack)", "second run (cache hit)"):
            t = time.perf_counter()
            ds = build_dataset(path, tok, context, cache_dir=cache)
            print(f"{label}: {time.perf_counter() - t:.1f} s")
    print(packing_report(ds))
