"""How are instruction datasets read a row at a time, how is validation held out, and what is the stdlib dataset?

An example is an {"instruction", "response"} pair or a chat {"messages": [{"role", "content"}, ...]} ending with the
assistant's turn, with its "source" ("file:line") for later messages. `read_examples` reads JSON lines or Parquet a
block at a time (a JSON array whole) in the Magicoder, Alpaca, pairs or messages layout; a malformed row stops the run
with one line naming file and line (skip_bad_rows: skipped and counted). Validation is held out by index over the
examples read (`split`). The stdlib dataset, the default: each documented function of this Python's standard library
as signature + docstring -> body, one in 20 (by a hash of its name) held out.
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

from support.formats.atomic import read_json, write_json

BLOCK_BYTES = 16 << 20  # JSON lines are read 16 MiB at a time
BLOCK_ROWS = 4096  # and Parquet 4,096 rows at a time
FORMATS = {
    "magicoder": ("problem", "solution"),
    "alpaca": ("instruction", "output"),
    "pairs": ("instruction", "response"),
}
STDLIB_SKIP = {"test", "tests", "idlelib", "lib2to3", "site-packages", "dist-packages", "__pycache__"}


def _rows(path):
    """(line, row or ValueError) pairs from JSON lines, a JSON array, or Parquet: JSON lines and Parquet a block at a
    time (memory bounded by the block, not the file), a JSON array whole."""
    if path.suffix == ".parquet":
        try:
            import pyarrow.parquet  # optional: only Parquet inputs need it
        except ImportError:
            raise ValueError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow)") from None
        batches = pyarrow.parquet.ParquetFile(path).iter_batches(batch_size=BLOCK_ROWS)
        yield from enumerate((row for batch in batches for row in batch.to_pylist()), 1)
        return
    with open(path, "rb") as f:
        head = f.read(BLOCK_BYTES)
        if head.removeprefix(b"\xef\xbb\xbf").lstrip().startswith(b"["):
            yield from _array(path, _decode(path, head + f.read(), 0).removeprefix("\ufeff"))
            return
        yield from _json_lines(path, f, head)


def _decode(path, raw, lines_before):
    """raw (whole lines of the file, after `lines_before` of them) as text; not UTF-8: one line naming the line."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:  # name the line, not just a byte offset into the file
        line, column = lines_before + raw.count(b"\n", 0, e.start) + 1, e.start - raw.rfind(b"\n", 0, e.start)
        raise ValueError(
            f"{path}:{line}: not UTF-8 text (byte 0x{raw[e.start]:02x} at byte {column} of the line); "
            "save the file as UTF-8"
        ) from None


def _json_lines(path, f, block):
    """(line, row or ValueError) of each non-blank line, reading `f` a block of whole lines at a time."""
    breaks, newlines, first = 0, 0, None  # line ends so far (any of them), b"\n"s so far, the first non-blank line
    while block:
        more = f.read(BLOCK_BYTES)
        cut = len(block) if not more else block.rfind(b"\n") + 1  # whole lines only: a "\r\n" is never cut in two
        if cut == 0:  # no line end in the block yet: read on
            block += more
            continue
        text = _decode(path, block[:cut], newlines)
        if newlines == 0:
            text = text.removeprefix("\ufeff")  # a byte-order mark, as Windows editors write, is no text
        # Line ends only: splitlines() would also cut at U+2028, U+0085 and others, which JSON strings may hold
        pieces = re.split(r"\r\n|\r|\n", text)
        for line, s in enumerate(pieces[:-1] if more else pieces, breaks + 1):
            if not s.strip():
                continue
            first = first or line
            yield line, _parse(path, line, s, first)
        breaks, newlines, block = breaks + len(pieces) - 1, newlines + block.count(b"\n", 0, cut), block[cut:] + more


def _parse(path, line, s, first):
    try:
        return json.loads(s)
    except json.JSONDecodeError as e:
        if line == first and _is_one_object(path.read_bytes().decode("utf-8", "replace").removeprefix("\ufeff")):
            raise ValueError(f"{path}: one JSON object, not rows; expected JSON lines or an array") from None
        return ValueError(f"{path}:{line}: invalid JSON ({e.msg}: column {e.colno})")


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


def read_examples(paths, fmt="auto", skip_bad_rows=False, said=None):
    """The examples of one file or of several read one after the other, a row at a time: {"instruction",
    "response"} or {"messages"} dicts, each with its "source" ("file:line", for messages about it later). fmt is
    "auto" (each file's own, from its first row), "magicoder", "alpaca", "pairs" or "messages". What is said about
    the rows (bad ones skipped) goes to stderr, or to the list `said` when given."""
    for path in [paths] if isinstance(paths, str | os.PathLike) else paths:
        path, count, bad, form = Path(path), 0, [], fmt
        if not path.exists():
            raise FileNotFoundError(f"{path}: no such data file")
        for line, row in _rows(path):
            try:
                if form == "auto" and not isinstance(row, Exception):
                    form = _detect(row, f"{path}:{line}")
                example = _example(row, form, f"{path}:{line}") | {"source": f"{path}:{line}"}
            except ValueError as e:
                if not skip_bad_rows:
                    raise
                bad.append(str(e))
                continue
            count += 1
            yield example
        if bad:
            note = f"{path}: skipped {len(bad)} bad rows (first: {bad[0]})"
            print(note, file=sys.stderr) if said is None else said.append(note)
        if not count:
            raise ValueError(f"{path}: no examples (empty file{' or only bad rows' if bad else ''})")


def held_out(n, val_fraction, seed=0):
    """Which of n examples are held out for validation (bool (n,)): a seeded random `val_fraction` of them."""
    order = np.random.default_rng(seed).permutation(n)
    val = np.zeros(n, dtype=bool)
    val[order[: int(round(n * val_fraction))]] = True
    return val


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
        if parts := function_parts(node, lines):
            out.append((f"{prefix}.{node.name}", *parts))
    return out


def function_parts(node, lines):
    """(signature + docstring, the rest of the body) of a function whose body starts with its docstring, dedented;
    None when a string literal runs out to the left margin (dedenting would change it)."""
    indent = lines[node.lineno - 1][: node.col_offset]
    if any(s.strip() and not s.startswith(indent) for s in lines[node.lineno - 1 : node.end_lineno]):
        return None
    cut = node.body[0].end_lineno
    parts = lines[node.lineno - 1 : cut], lines[cut : node.end_lineno]
    return tuple("\n".join(s[len(indent) :] for s in part).rstrip() for part in parts)


def stdlib_paths():
    """The .py files of this Python's standard library, its tests and third-party packages left out, in order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for dirpath, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in STDLIB_SKIP)
        yield from sorted(Path(dirpath, f) for f in files if f.endswith(".py"))


def stdlib_files():
    """(path relative to the standard library, its lines, its syntax tree) of each parseable stdlib_paths file."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in stdlib_paths():
        try:
            lines = path.read_text(encoding="utf-8").splitlines()
            tree = ast.parse("\n".join(lines))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue  # a few stdlib files are deliberately invalid or not UTF-8
        yield path.relative_to(root), lines, tree


def stdlib_key(extract) -> str:
    """What stdlib_cached's file is named by: the Python build, the library's files (path, size, modification time:
    a package added to it, such as tkinter from the system's packages, changes it) and the source of this module and
    of `extract`'s, so another Python or an edit of the extraction reads the library again."""
    h = hashlib.sha256(f"{sys.version}\n".encode())
    for path in stdlib_paths():
        st = path.stat()
        h.update(f"{path}\t{st.st_size}\t{st.st_mtime_ns}\n".encode())
    for module in sorted({__file__, sys.modules[extract.__module__].__file__}):
        h.update(Path(module).read_bytes())
    return h.hexdigest()[:16]


def stdlib_cached(extract, cache_dir=None):
    """extract(), a JSON list drawn from stdlib_files, kept in cache_dir when one is given: parsing the whole library
    takes seconds at every start, reading the file back a tenth of a second. A file that does not read back (cut
    short, edited) is parsed again and rewritten, and a cache_dir that cannot be written costs the next start the
    parse, each with a warning line."""
    if not cache_dir:
        return extract()
    path = Path(cache_dir) / f"stdlib-{extract.__name__}-{stdlib_key(extract)}.json"
    if path.is_file():
        try:
            return read_json(path)
        except ValueError as e:  # cut short or edited (invalid JSON, not UTF-8): parsed again and rewritten below
            print(f"warning: {str(e).splitlines()[0][:200]}; the standard library is parsed again")
    found = extract()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json(path, found)  # whole or not at all: ranks and runs may write it at once
    except OSError as e:
        print(f"warning: {e}: the standard library is parsed again at the next start")
    return found


@functools.lru_cache(maxsize=1)
def stdlib_functions():
    """(qualified name, signature + docstring, body) of every documented function of the standard library."""
    out = []
    for rel, lines, tree in stdlib_files():
        out += _functions(tree.body, lines, ".".join(rel.with_suffix("").parts))
    return out


def stdlib_examples(split="train", cache_dir=None):
    """Signature + docstring -> body pairs from this Python's standard library, real code available offline.
    One function in 20, chosen by a hash of its qualified name, is held out as "val"."""
    return _stdlib_split(stdlib_cached(stdlib_functions, cache_dir), split)


def _stdlib_split(functions, split):
    out = []
    for name, head, body in functions:
        if (int(hashlib.sha1(name.encode()).hexdigest()[:8], 16) % 20 == 0) == (split == "val"):
            instruction = f"Complete this Python function from `{name.rsplit('.', 1)[0]}`.\n\n{head}"
            # fenced, as chat models answer: a bare body's indentation right after the chat header would tokenize
            # differently from the body alone
            out.append({"instruction": instruction, "response": f"```python\n{body}\n```", "name": name})
    return out


def first(kept, limit):
    """`kept` (bool (n,)) with only its first `limit` True (0: all)."""
    if limit:
        kept = kept.copy()
        kept[np.flatnonzero(kept)[limit:]] = False
    return kept


def sources(files, cache_dir=None):
    """(training data, validation data): each the files to read one after the other (files: {"data": paths,
    "val_data": paths}) or, without data, the stdlib dataset's split as a list (kept in cache_dir). Validation None:
    held out of the training data, whose one token stream serves both splits."""
    if not files["data"]:
        functions = stdlib_cached(stdlib_functions, cache_dir)  # read once for both splits
        return _stdlib_split(functions, "train"), _stdlib_split(functions, "val")
    return files["data"], files["val_data"] or None


def split(cfg, stream, val_stream=None):
    """The index masks (bool) of the examples each split takes, (training, validation), over the examples each token
    stream read (pack.tokenized): validation is every example of its own stream, or without one (None) val_fraction of
    the training stream's n examples held out; training takes at most the first max_examples of what is left."""
    n = stream["read"]
    if val_stream is not None:
        return first(np.ones(n, dtype=bool), cfg.max_examples), np.ones(val_stream["read"], dtype=bool)
    val = held_out(n, cfg.val_fraction, cfg.seed)
    if val.all() or not val.any():
        left = "holds out none" if not val.any() else "leaves none to train on"
        raise ValueError(f"val_fraction: {cfg.val_fraction} of the {n} examples in {cfg.data} {left}")
    return first(~val, cfg.max_examples), val


def selected(data, kept, fmt="auto", skip_bad_rows=False):
    """The examples of `data` (files, or a list) that `kept` (bool (n,)) takes, read lazily: the first few cost the
    reading of the rows before them only. The files were read before: what is said about their rows is not again."""
    rows = data if data and isinstance(data[0], dict) else read_examples(data, fmt, skip_bad_rows, said=[])
    return (ex for ex, k in zip(rows, kept, strict=False) if k)  # stops early: not strict
