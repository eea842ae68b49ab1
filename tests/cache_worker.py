"""Run under torchrun by test_token_cache.py: build a dataset from argv[2] with the tokenizer of argv[1] through the
token cache argv[3], as train.py does under torchrun (process group, one-line errors), then write argv[4]/rank<R>.json:
this rank, how many texts it encoded, the files its arrays map and its rows."""

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import pack  # noqa: E402
from support.data.tokenizer import Tokenizer  # noqa: E402
from support.run import ranks  # noqa: E402


def main():
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ranks.init_process_group("gloo", rank, world, timeout_minutes=2)
    tok, encoded = Tokenizer(sys.argv[1]), []
    real = tok.encode_batch
    tok.encode_batch = lambda texts: encoded.append(len(texts)) or real(texts)
    ds = pack.build_dataset(sys.argv[2], tok, 64, cache_dir=sys.argv[3], fmt="magicoder")
    files = sorted(a.filename for a in (ds.tokens, ds.mask))
    with open(os.path.join(sys.argv[4], f"rank{rank}.json"), "w") as f:
        json.dump({"rank": rank, "encoded": sum(encoded), "files": files, "rows": ds.rows}, f)


if __name__ == "__main__":
    ranks.one_line_errors(main)
