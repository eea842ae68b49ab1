"""Training examples: instruction datasets read from files, and a real code dataset that ships with Python.

An example is an {"instruction", "response"} pair or a chat {"messages": [{"role", "content"}, ...]} conversation
ending with the assistant's turn (every assistant turn is trained on, see tokenizer.py). `load_examples` reads JSON
lines, a JSON array or Parquet and recognises the common layouts by their keys: Magicoder (problem, solution), Alpaca
(instruction, input, output), plain pairs (instruction, response) and chat messages. A malformed row stops the run
with one line naming the file and line (or is skipped and counted with skip_bad_rows); a JSON array is walked item by
item so that its errors name a line too. Each example keeps its "file:line" as "source", so that what tokenizing it
finds later (a chat template that rejects it, a warning of the preview) names the line as well.

The stdlib dataset is the default: every documented function and method of this Python's standard library becomes a
"complete this function" example, signature + docstring -> body, verbatim from the source. The body is answered in a
```python block, as chat models answer: a bare body starts with indentation, which right after the chat header's
newline would tokenize differently from the body alone. A few thousand examples of real code of every length from
one line to hundreds, available offline on any machine. One function in 20, chosen by a hash of its qualified name
(so the split never changes), is held out for validation.
"""

import ast
import functools
import hashlib
import json
import os
import re
import sys
import sysconfig
from pathlib import Path

import numpy as np

FORMATS = {
    "magicoder": ("problem", "solution"),
    "alpaca": ("instruction", "output"),
    "pairs": ("instruction", "response"),
}


def _rows(path):
    """(line, row or ValueError) pairs from JSON lines, a JSON array, or Parquet."""
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet  # optional: only Parquet inputs need it
        except ImportError:
            raise ValueError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
        yield from enumerate(pyarrow.parquet.read_table(path).to_pylist(), 1)
        return
    raw = path.read_bytes()
    try:
        text = raw.decode("utf-8").removeprefix("\ufeff")  # a byte-order mark, as Windows editors write, is no text
    except UnicodeDecodeError as e:  # name the line, not just a byte offset into the file
        line, column = raw.count(b"\n", 0, e.start) + 1, e.start - raw.rfind(b"\n", 0, e.start)
        raise ValueError(
            f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x} at byte {column} of the line); "
            "save the file as UTF-8"
        ) from None
    if text.lstrip().startswith("["):
        yield from _array(path, text)
        return
    # Line ends only: splitlines() would also cut at U+2028, U+0085 and others, which JSON strings may hold unescaped
    lines = [(line, s) for line, s in enumerate(re.split(r"\r\n|\r|\n", text), 1) if s.strip()]
    for line, s in lines:
        try:
            row = json.loads(s)
        except json.JSONDecodeError as e:
            if line == lines[0][0] and _is_one_object(text):  # a pretty-printed object fails on its first line
                raise ValueError(f"{path}: one JSON object, not rows; expected JSON lines or an array") from None
            row = ValueError(f"{path}:{line}: invalid JSON ({e.msg}: column {e.colno})")
        yield line, row


def _is_one_object(text):
    try:
        return isinstance(json.loads(text), dict)
    except json.JSONDecodeError:
        return False


def _array(path, text):
    """(line, row) per item of a JSON array, walked item by item so that each row knows its line. Anything but one
    comma between items, a closing bracket and nothing after it is fatal even with skip_bad_rows: an array cannot be
    resynchronised, and a second array pasted after the first would otherwise be dropped without a word."""
    dec, ws, counted = json.JSONDecoder(), re.compile(r"\s*"), [0, 1]  # [position, its line]

    def line(pos):  # positions only grow, so lines are counted once
        counted[:] = pos, counted[1] + text.count("\n", counted[0], pos)
        return counted[1]

    i = ws.match(text, text.index("[") + 1).end()
    closed = text.startswith("]", i)
    while not closed:
        try:  # after a comma an item must follow: "[a,]" fails here
            row, j = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{e.lineno}: invalid JSON ({e.msg}: column {e.colno})") from None
        yield line(i), row
        i = ws.match(text, j).end()
        if not text.startswith((",", "]"), i):
            raise ValueError(f"{path}:{line(i)}: invalid JSON array (expected ',' or ']' after the item)")
        closed = text[i] == "]"
        i = i if closed else ws.match(text, i + 1).end()
    if (end := ws.match(text, i + 1).end()) < len(text):
        raise ValueError(f"{path}:{line(end)}: text after the array's closing ']' (one array per file)")


def _example(row, fmt, where):
    if isinstance(row, Exception):
        raise row
    if not isinstance(row, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
    if fmt == "messages":
        msgs = row.get("messages")
        if not isinstance(msgs, list) or not msgs:
            raise ValueError(f"{where}: field 'messages' must be a non-empty list of {{role, content}} objects")
        for k, m in enumerate(msgs):
            if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
                raise ValueError(f"{where}: messages[{k}] needs string 'role' and 'content'")
        if msgs[-1]["role"] != "assistant":
            raise ValueError(f"{where}: the last message must be the assistant's, got '{msgs[-1]['role']}'")
        return {"messages": [{"role": m["role"], "content": m["content"]} for m in msgs]}
    src, dst = FORMATS[fmt]
    extra = ("input",) if fmt == "alpaca" and row.get("input") is not None else ()
    for k in (src, dst, *extra):
        if k not in row:
            raise ValueError(f"{where}: missing field '{k}'")
        if not isinstance(row[k], str):
            raise ValueError(f"{where}: field '{k}' must be a string, got {type(row[k]).__name__}")
    instruction = row[src] + ("\n\n" + row["input"] if extra and row["input"] else "")
    return {"instruction": instruction, "response": row[dst]}


def _detect(row, where):
    keys = set(row) if isinstance(row, dict) else set()
    found = ["messages"] * ("messages" in keys) + [f for f, (a, b) in FORMATS.items() if {a, b} <= keys]
    if not found:
        known = "'messages', 'problem'+'solution', 'instruction'+'output' or 'instruction'+'response'"
        raise ValueError(f"{where}: cannot tell the format from keys {sorted(keys)}; expected {known}")
    return found[0]


def load_examples(path, fmt="auto", skip_bad_rows=False):
    """Rows of a .jsonl / .json (array) / .parquet file as {"instruction", "response"} or {"messages"} dicts, each
    with its "source" ("file:line", for messages about it later); fmt is "auto", "magicoder", "alpaca", "pairs" or
    "messages"."""
    path, examples, bad = Path(path), [], []
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such data file")
    for line, row in _rows(path):
        try:
            if fmt == "auto" and not isinstance(row, Exception):
                fmt = _detect(row, f"{path}:{line}")
            examples.append(_example(row, fmt, f"{path}:{line}") | {"source": f"{path}:{line}"})
        except ValueError as e:
            if not skip_bad_rows:
                raise
            bad.append(str(e))
    if bad:
        print(f"{path}: skipped {len(bad)} bad rows (first: {bad[0]})", file=sys.stderr)
    if not examples:
        raise ValueError(f"{path}: no examples (empty file{' or only bad rows' if bad else ''})")
    return examples


def split_examples(examples, val_fraction, seed=0):
    """(train, val): a seeded random `val_fraction` of the examples held out, both in their original order."""
    order = np.random.default_rng(seed).permutation(len(examples))
    n_val = int(round(len(examples) * val_fraction))
    return [examples[i] for i in sorted(order[n_val:])], [examples[i] for i in sorted(order[:n_val])]


def _functions(body, lines, prefix):
    """(qualified name, signature + docstring, body) for documented functions and methods, not nested functions."""
    out = []
    for node in body:
        if isinstance(node, ast.ClassDef):
            out += _functions(node.body, lines, f"{prefix}.{node.name}")
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or len(node.body) < 2:
            continue
        doc, first, rest = ast.get_docstring(node), node.body[0], node.body[1:]
        if not doc or len(doc) < 40 or ". " not in doc + " " or doc.lstrip().upper().startswith(("TODO", "XXX")):
            continue
        if first.end_lineno >= rest[0].lineno or all(isinstance(s, ast.Pass | ast.Expr) for s in rest):
            continue  # the docstring shares a line with code, or the body is only `pass` / `...`
        d = lines[node.lineno - 1][: node.col_offset]  # the def's indentation, removed from every line
        if any(s.strip() and not s.startswith(d) for s in lines[node.lineno - 1 : node.end_lineno]):
            continue  # a string literal runs out to the left margin: dedenting would change it
        head, tail = lines[node.lineno - 1 : first.end_lineno], lines[first.end_lineno : node.end_lineno]
        out.append((f"{prefix}.{node.name}", *("\n".join(s[len(d) :] for s in p).rstrip() for p in (head, tail))))
    return out


@functools.lru_cache(maxsize=1)
def _stdlib_functions():
    root, out = Path(sysconfig.get_paths()["stdlib"]), []
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = sorted(
            d for d in dirs if d not in {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages"}
        )
        for path in sorted(Path(dirpath, f) for f in files if f.endswith(".py")):
            try:
                lines = path.read_text(encoding="utf-8").splitlines()
                tree = ast.parse("\n".join(lines))
            except (SyntaxError, UnicodeDecodeError, ValueError):
                continue  # a few stdlib files are deliberately invalid or not UTF-8
            out += _functions(tree.body, lines, ".".join(path.relative_to(root).with_suffix("").parts))
    return out


def stdlib_examples(split="train"):
    """Signature + docstring -> body pairs from this Python's standard library, real code available offline.
    One function in 20, chosen by a hash of its qualified name, is held out as "val"."""
    out = []
    for name, head, body in _stdlib_functions():
        if (int(hashlib.sha1(name.encode()).hexdigest()[:8], 16) % 20 == 0) == (split == "val"):
            instruction = f"Complete this Python function from `{name.rsplit('.', 1)[0]}`.\n\n{head}"
            out.append({"instruction": instruction, "response": f"```python\n{body}\n```", "name": name})
    return out


def train_and_val(cfg, files) -> tuple[list, list]:
    """The training and validation examples a train.Config asks for, from its data files (`files`: {"data": paths,
    "val_data": paths}, several files read one after the other): val_data's, or val_fraction of data held out; without
    data the stdlib dataset's two splits. At most max_examples for training."""
    read = lambda paths: [ex for p in paths for ex in load_examples(p, cfg.data_format, cfg.skip_bad_rows)]  # noqa: E731
    if files["data"]:
        train_examples = read(files["data"])
        if files["val_data"]:
            val_examples = read(files["val_data"])
        else:
            n = len(train_examples)
            train_examples, val_examples = split_examples(train_examples, cfg.val_fraction, seed=cfg.seed)
            if not (val_examples and train_examples):
                left = "holds out none" if not val_examples else "leaves none to train on"
                raise ValueError(f"val_fraction: {cfg.val_fraction} of the {n} examples in {cfg.data} {left}")
    else:
        train_examples, val_examples = stdlib_examples("train"), stdlib_examples("val")
    if cfg.max_examples:
        train_examples = train_examples[: cfg.max_examples]
    return train_examples, val_examples
