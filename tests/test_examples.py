"""examples.py against its inputs: every supported file layout (JSON lines, JSON arrays, Magicoder, Alpaca, pairs,
chat messages) reads to the same examples, malformed rows fail with one line naming the file and line (or are skipped
and counted), the validation split is seeded, and the stdlib dataset's bodies (answered in a ```python block) are the
real source of real functions with a deterministic held-out split, parsed once per Python and library into cache_dir.
"""

import ast
import importlib
import inspect
import json
import re
import sys
import sysconfig
import textwrap

import pytest
from conftest import CONVERSATIONS

from support.data import examples, problems
from support.data.examples import read_examples, stdlib_examples


def load_examples(path, **options):
    """Every example of the file in a list."""
    return list(read_examples(path, **options))


def _write(path, rows):
    path.write_text("\n".join(r if isinstance(r, str) else json.dumps(r) for r in rows) + "\n")
    return path


def test_load_formats(tmp_path):
    magi = _write(
        tmp_path / "m.jsonl",
        [{"problem": "p1", "solution": "s1", "lang": "py"}, "", {"problem": "p2", "solution": "s2"}],
    )
    at = lambda path, line: {"source": f"{path}:{line}"}  # noqa: E731
    assert load_examples(magi) == [
        {"instruction": "p1", "response": "s1"} | at(magi, 1),
        {"instruction": "p2", "response": "s2"} | at(magi, 3),
    ]
    alpaca = tmp_path / "a.json"
    alpaca.write_text(
        json.dumps(
            [{"instruction": "i", "input": "x", "output": "o"}, {"instruction": "j", "input": "", "output": "p"}],
            indent=2,
        )
    )
    assert load_examples(alpaca) == [  # each item's line is the line of its opening brace
        {"instruction": "i\n\nx", "response": "o"} | at(alpaca, 2),
        {"instruction": "j", "response": "p"} | at(alpaca, 7),
    ]
    chat = _write(tmp_path / "c.jsonl", [{"messages": CONVERSATIONS[1]}])
    assert load_examples(chat)[0]["messages"][1] == {"role": "user", "content": "Hi"}


@pytest.mark.parametrize(
    "rows, message",
    [
        ([{"problem": "a", "solution": "b"}, '{"problem": "a", "solution": '], r"x\.jsonl:2: invalid JSON"),
        ([{"problem": "a", "solution": "b"}, "", {"problem": "a"}], r"x\.jsonl:3: missing field 'solution'"),
        ([{"problem": "a", "solution": 7}], r"x\.jsonl:1: field 'solution' must be a string, got int"),
        ([{"messages": [{"role": "user", "content": "hi"}]}], r"x\.jsonl:1: the last message must be the assistant"),
        ([{"text": "a"}], r"x\.jsonl:1: cannot tell the format"),
        ([], r"x\.jsonl: no examples \(empty file\)"),
    ],
)
def test_bad_input_names_file_and_line(tmp_path, rows, message):
    with pytest.raises(ValueError, match=message):
        load_examples(_write(tmp_path / "x.jsonl", rows))


def test_bad_json_array_line_and_skip_bad_rows(tmp_path, capsys):
    arr = tmp_path / "a.json"
    arr.write_text('[\n  {"problem": "a", "solution": "b"},\n  {"problem": "c", "solution": 1},\n  {"problem": }\n]')
    with pytest.raises(ValueError, match=r"a\.json:3: field 'solution' must be a string"):
        load_examples(arr)
    with pytest.raises(ValueError, match=r"a\.json:4: invalid JSON"):
        load_examples(arr, skip_bad_rows=True)  # a broken array cannot be resynchronised
    good = {"problem": "a", "solution": "b"}
    path = _write(tmp_path / "x.jsonl", [good, "{oops", {"problem": "a"}, {"problem": 1, "solution": "b"}, good])
    assert load_examples(path, skip_bad_rows=True) == [
        {"instruction": "a", "response": "b", "source": f"{path}:{line}"} for line in (1, 5)
    ]
    assert "skipped 3 bad rows (first: " + str(path) + ":2: invalid JSON" in capsys.readouterr().err


def test_unicode_line_separators_and_bom_are_text(tmp_path):
    """JSON strings may hold U+2028, U+2029 and U+0085 unescaped (json.dumps(ensure_ascii=False) writes them so): they
    are not line ends; CR LF and a lone CR are. A byte-order mark, as Windows editors write one, is not text."""
    rows = [{"problem": f"a{c}b", "solution": "c"} for c in "\u2028\u2029\x85"]
    path = tmp_path / "u.jsonl"
    path.write_text("\ufeff" + "".join(json.dumps(r, ensure_ascii=False) + "\r\n" for r in rows), encoding="utf-8")
    assert [ex["instruction"] for ex in load_examples(path)] == [r["problem"] for r in rows]
    assert [ex["source"] for ex in load_examples(path)] == [f"{path}:{line}" for line in (1, 2, 3)]
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\r" for r in rows), encoding="utf-8")  # old Mac
    assert [ex["source"] for ex in load_examples(path)] == [f"{path}:{line}" for line in (1, 2, 3)]


ROW = '{"problem": "a", "solution": "b"}'


@pytest.mark.parametrize(
    "text, message",
    [
        (f"[{ROW}]\n[{ROW}, {ROW}]\n", r"a\.json:2: text after the array's closing '\]' \(one array per file\)"),
        (f"[{ROW}] and more", r"a\.json:1: text after the array's closing"),
        (f"[\n{ROW}\n{ROW}\n]", r"a\.json:3: invalid JSON array \(expected ',' or '\]' after the item\)"),
        (f"[{ROW},\n]", r"a\.json:2: invalid JSON \(Expecting value: column 1\)"),
        (f"[,{ROW}]", r"a\.json:1: invalid JSON \(Expecting value: column 2\)"),
        (f"[{ROW},\n{ROW},", r"a\.json:2: invalid JSON \(Expecting value: column 35\)"),
        ('{\n  "data": [' + ROW + "]\n}\n", r"a\.json: one JSON object, not rows; expected JSON lines or an array"),
    ],
)
def test_a_malformed_json_file_is_one_line_even_with_skip_bad_rows(tmp_path, text, message):
    """Two arrays pasted together, a missing or stray comma, an unclosed array, a top-level object: each was read in
    part without a word or failed on every line; now each is one line naming the file and line."""
    (path := tmp_path / "a.json").write_text(text)
    with pytest.raises(ValueError, match=f"^{re.escape(str(tmp_path))}/{message}"):
        load_examples(path, skip_bad_rows=True)


def test_a_json_array_names_lines_counted_from_the_top(tmp_path):
    """Blank lines before the array count: the bad item is on line 5."""
    (path := tmp_path / "a.json").write_text(f'\n\n[\n  {ROW},\n  {{"problem": 1, "solution": "b"}}\n]\n')
    with pytest.raises(ValueError, match=r"a\.json:5: field 'problem' must be a string"):
        load_examples(path)
    assert load_examples(path, skip_bad_rows=True)[0]["source"] == f"{path}:4"


def test_parquet_without_pyarrow_says_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)  # an import of it raises ImportError
    (path := tmp_path / "d.parquet").write_bytes(b"PAR1")
    with pytest.raises(ValueError, match=r"d\.parquet: .*pip install pyarrow"):
        load_examples(path)


def stand_in(function, calls, returns=None):
    """A function named and placed as `function` (so stdlib_cached names its file alike) that counts its calls and
    returns `returns` (a one-function library by default)."""

    def extract():
        calls.append(function.__name__)
        return returns if returns is not None else [["mod.f", 'def f(x):\n    """Twice x. Really."""', "return 2 * x"]]

    extract.__name__, extract.__module__ = function.__name__, function.__module__
    return extract


def test_the_stdlib_dataset_is_parsed_once_per_python(tmp_path, monkeypatch, capsys, stdlib_candidates):
    """With a cache_dir, the parsed library is kept there as JSON and read back, not parsed again: the examples and
    the doctest candidates read back equal a fresh parse while the extraction would fail if called. A file cut short
    is parsed again and rewritten, and a cache_dir that cannot be written still gives the data, each with one warning
    line."""
    val = stdlib_examples("val")
    assert stdlib_examples("val", tmp_path) == val
    parsed = list(stdlib_candidates.values())  # the fixture's fresh parse, written as the real extraction's file
    assert examples.stdlib_cached(stand_in(problems.stdlib_candidates, [], parsed), tmp_path) == parsed
    calls = []
    monkeypatch.setattr(examples, "stdlib_functions", stand_in(examples.stdlib_functions, calls))
    assert stdlib_examples("val", tmp_path) == val
    read = examples.stdlib_cached(stand_in(problems.stdlib_candidates, calls), tmp_path)
    assert read == list(stdlib_candidates.values()) and calls == []
    (kept,) = tmp_path.glob("stdlib-stdlib_functions-*.json")
    kept.write_text(kept.read_text()[:1000])
    got = stdlib_examples("train", tmp_path) + stdlib_examples("val", tmp_path)
    assert [e["name"] for e in got] == ["mod.f"] and calls == ["stdlib_functions"]  # parsed (the stand-in) once
    assert json.loads(kept.read_text()) == [["mod.f", 'def f(x):\n    """Twice x. Really."""', "return 2 * x"]]
    (blocked := tmp_path / "file").write_text("")
    assert stdlib_examples("train", blocked / "cache") == got[:1]  # a file where the folder should be
    assert calls == ["stdlib_functions"] * 2
    cut, unwritable = capsys.readouterr().out.splitlines()
    assert cut.startswith(f"warning: {kept}: invalid JSON") and cut.endswith("the standard library is parsed again")
    assert unwritable.startswith("warning: ") and unwritable.endswith("parsed again at the next start")


def test_the_stdlib_cache_is_named_by_python_library_and_code(tmp_path, monkeypatch):
    """stdlib_cached writes a new file, and so parses again, for another Python build, a file added to the library,
    an edit of examples.py (which problems.py's extraction calls into) and another extracting module; the same of all
    four reads the file back."""
    lib, cache, calls = tmp_path / "lib", tmp_path / "cache", []
    (lib / "json").mkdir(parents=True)
    (lib / "json" / "decoder.py").write_text("x = 1\n")
    monkeypatch.setattr(sysconfig, "get_paths", lambda: {"stdlib": str(lib)})
    extract = stand_in(problems.stdlib_candidates, calls)  # problems.py's, which calls into examples.py
    examples.stdlib_cached(extract, cache)
    examples.stdlib_cached(extract, cache)
    assert len(calls) == 1
    (lib / "json" / "tool.py").write_text("y = 2\n")
    examples.stdlib_cached(extract, cache)
    monkeypatch.setattr(sys, "version", sys.version + " (another build)")
    examples.stdlib_cached(extract, cache)
    edited = tmp_path / "examples.py"
    edited.write_text(open(examples.__file__).read() + "# an edit\n")
    monkeypatch.setattr(examples, "__file__", str(edited))
    examples.stdlib_cached(extract, cache)
    examples.stdlib_cached(stand_in(examples.stdlib_functions, calls), cache)
    examples.stdlib_cached(extract, cache)
    assert len(calls) == 5 and len(list(cache.glob("stdlib-*.json"))) == 5


def test_stdlib_examples_are_real_code():
    train, val = stdlib_examples("train"), stdlib_examples("val")
    assert len(train) > 2000 and 0.02 < len(val) / (len(train) + len(val)) < 0.1
    assert not {e["name"] for e in train} & {e["name"] for e in val}
    examples.stdlib_functions.cache_clear()
    assert stdlib_examples("val") == val  # a fresh walk gives the same split
    checked = 0
    for e in train + val:
        head, body = e["instruction"].split("\n\n", 1)[1], e["response"][len("```python\n") : -len("\n```")]
        assert e["response"] == f"```python\n{body}\n```"  # the body, answered in a code block
        fn = ast.parse(head + "\n" + body).body[0]  # signature + docstring + body is a whole function
        assert ast.get_docstring(fn) and body.strip() and ast.get_docstring(fn) not in body
        if (obj := _resolve(e["name"])) is not None:  # and it is the function's real source, formatting and all
            assert head + "\n" + body + "\n" in textwrap.dedent(inspect.getsource(obj))
            checked += 1
    assert checked > 100


SAFE_MODULES = {"json", "textwrap", "argparse", "_pydecimal", "fractions", "ast", "difflib", "shlex", "statistics"}


def _resolve(name):
    """The function object behind a qualified name, for a few modules that are safe to import."""
    module, *attrs = name.split(".")
    if module not in SAFE_MODULES:
        return None
    obj = importlib.import_module(module)
    while attrs and hasattr(obj, "__path__"):  # a package: descend into its submodules
        obj = importlib.import_module(f"{obj.__name__}.{attrs.pop(0)}")
    for a in attrs:
        obj = getattr(obj, a, None)
    return obj if inspect.isfunction(obj) else None


def test_json_lines_read_in_small_blocks_are_the_whole_file_read_at_once(tmp_path, monkeypatch):
    """Read a few bytes at a time (blocks cut through rows, CR LF pairs and UTF-8 characters), a file gives the same
    examples, lines and errors as read in one block: lone CRs, CR LFs, blank lines, a BOM, a bad row, non-ASCII text;
    a byte that is not UTF-8 names its line and column either way."""
    rows = [{"problem": f"é{i}\u2028" * (i % 5), "solution": "s" * i} for i in range(40)]
    text = "\ufeff" + "".join(json.dumps(r, ensure_ascii=False) + ("\r\n", "\n", "\r", "\n\n")[i % 4] for i, r in
                              enumerate(rows))  # fmt: skip
    (path := tmp_path / "b.jsonl").write_text(text.replace(json.dumps(rows[7], ensure_ascii=False), "{oops"))
    (bad := tmp_path / "u.jsonl").write_bytes(text.encode().replace(b"s" * 30, b"s" * 29 + b"\xff"))
    whole = load_examples(path, skip_bad_rows=True), _error(bad)
    for size in (7, 64, 1000):
        monkeypatch.setattr(examples, "BLOCK_BYTES", size)
        assert (load_examples(path, skip_bad_rows=True), _error(bad)) == whole
    assert len(whole[0]) == 39 and whole[0][8]["source"] == f"{path}:12" and "not UTF-8 text (byte 0xff" in whole[1]


def _error(path):
    with pytest.raises(ValueError) as e:
        load_examples(path)
    return str(e.value)


def test_the_split_by_index_is_the_split_of_the_examples(tmp_path):
    """split's index masks, over the n examples a file's token stream read, take exactly the examples a seeded
    permutation of the n (held_out) holds out, and the rest, both in file order; max_examples the first of the rest; a
    validation file of its own gives every one of its examples; a share that holds out none is one line."""
    rows = [{"problem": f"p{i}", "solution": "s"} for i in range(50)]
    path = _write(tmp_path / "d.jsonl", rows)
    cfg = type("Config", (), dict(val_fraction=0.2, seed=3, max_examples=0, data=str(path)))
    stream, held = {"read": 50}, examples.held_out(50, 0.2, seed=3)
    train, val = examples.split(cfg, stream)
    in_memory = load_examples(path)
    want = [[ex for ex, v in zip(in_memory, held, strict=True) if v == side] for side in (False, True)]
    assert [list(examples.selected([path], kept)) for kept in (train, val)] == want and val.sum() == 10
    cfg.max_examples = 7
    assert list(examples.selected([path], examples.split(cfg, stream)[0])) == want[0][:7]
    train, val = examples.split(cfg, stream, {"read": 5})
    assert train.tolist() == [True] * 7 + [False] * 43 and val.tolist() == [True] * 5
    cfg.val_fraction = 0.001
    with pytest.raises(ValueError, match=r"^val_fraction: 0.001 .*holds out none"):
        examples.split(cfg, stream)
