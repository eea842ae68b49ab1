"""modelfile.py writes the Ollama Modelfile beside each GGUF that gguf_write.export_gguf writes, against transformers
rendering the same chat templates:
- the Modelfile's TEMPLATE and SYSTEM render conversations as transformers renders the chat template (SmolLM2, a
  ChatML with a default system prompt, Qwen2.5; a BOS the tokenizer adds is left out);
- templates that cannot be expressed (Qwen3, Llama 3's trimming, Mistral's, Llama 2's) give no TEMPLATE and one line
  that says why.
"""

import codecs
import json
import os
import re

import pytest
from conftest import CHATML, reference
from test_gguf_read import MESSAGES
from test_gguf_write import LLAMA, _model_dir
from transformers import AutoTokenizer

from support.data import tokenizer
from support.formats import gguf_write, modelfile

GO_STRING = re.compile(r'\{\{ "((?:[^"\\]|\\.)*)" \}\}')


def _go_literals(fragment):
    """The text the Go string actions of a template fragment print. Go's escapes used there (\\" \\\\ \\n \\t \\r
    \\uXXXX \\UXXXXXXXX, ASCII only) read the same as Python's unicode_escape."""
    return "".join(codecs.decode(s.encode("ascii"), "unicode_escape") for s in GO_STRING.findall(fragment))


def _read_modelfile(text):
    """{"FROM", "TEMPLATE", "SYSTEM", "stop"} of a Modelfile (absent directives are None)."""
    get = lambda pattern: (m := re.search(pattern, text, re.S | re.M)) and m[1]  # noqa: E731
    return dict(
        FROM=get(r"^FROM ([^\n]+)$"),
        TEMPLATE=get(r'^TEMPLATE """(.*?)"""$'),
        SYSTEM=get(r'^SYSTEM """(.*?)"""$'),
        stop=re.findall(r'^PARAMETER stop "(.*)"$', text, re.M),
    )


def _ollama_render(template, system, messages):
    """What Ollama makes of `messages` with our TEMPLATE (read line by line: the prefix, each role's text around
    {{ $m.Content }}, the assistant's closing text unless it is the last message, the reply prompt after a last
    message that is not the assistant's) and SYSTEM (the first message when the request has none)."""
    lines = template.split("\n")
    assert lines[0].endswith("{{- range $i, $m := .Messages }}") and "(slice $.Messages $i)) 1" in lines[1]
    around = {}
    for line, role in zip(lines[2:5], ("system", "user", "assistant"), strict=True):
        assert f'eq $m.Role "{role}" }}}}' in line
        before, after = line.split("{{ $m.Content }}")
        around[role] = _go_literals(before), _go_literals(after)
    assert lines[5].startswith("{{- if not $last }}") and lines[7].startswith("{{- if and $last (ne $m.Role")
    close, reply = _go_literals(lines[5]), _go_literals(lines[7])
    if system and all(m["role"] != "system" for m in messages):
        messages = [{"role": "system", "content": system}, *messages]
    out = _go_literals(lines[0])
    for i, m in enumerate(messages):
        last = i == len(messages) - 1
        out += around[m["role"]][0] + m["content"] + around[m["role"]][1]
        out += close if m["role"] == "assistant" and not last else ""
        out += reply if last and m["role"] != "assistant" else ""
    return out


SYSTEM = {"role": "system", "content": "You answer in one line."}
CONVERSATIONS = [MESSAGES, [SYSTEM, *MESSAGES], MESSAGES[:1], [SYSTEM, *MESSAGES[:1]]]


def test_smollm2_modelfile(smol_export, smollm2_dir):
    """FROM names the GGUF beside it; TEMPLATE and SYSTEM render conversations (with and without a system message)
    exactly as transformers renders SmolLM2's chat template; the stop tokens include eos and are special tokens."""
    text = open(modelfile.modelfile_path(smol_export[0])).read()
    mf = _read_modelfile(text)
    assert mf["FROM"] == "./" + os.path.basename(smol_export[0])
    ref = AutoTokenizer.from_pretrained(smollm2_dir)
    for messages in CONVERSATIONS:
        expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert _ollama_render(mf["TEMPLATE"], mf["SYSTEM"], messages) == expected
    assert mf["SYSTEM"] and mf["SYSTEM"] in ref.apply_chat_template(MESSAGES[:1], tokenize=False)
    specials = {t.content for t in ref.added_tokens_decoder.values() if t.special}
    assert ref.eos_token in mf["stop"] and set(mf["stop"]) <= specials
    assert "\t" not in text and all(c == "\n" or " " <= c <= "~" for c in text)  # nothing Ollama's parser drops


@pytest.mark.parametrize("family", ["chatml", "qwen2.5", "qwen3", "llama3-style", "mistral-v0.1", "mistral-legacy"])
def test_chat_template_derivation(family_dirs, bpe_dir, family):
    """Where the derived TEMPLATE exists it renders like transformers (Qwen2.5 with its default system prompt as
    SYSTEM); where the template cannot be expressed (Qwen3's final-turn think block, Llama 3's trimming of contents,
    Mistral's system message inside a user turn or refused) there is one line that says why."""
    d = bpe_dir if family == "chatml" else family_dirs[family]
    turns, why = modelfile.chat_turns(tokenizer.Tokenizer(d))
    if family not in ("chatml", "qwen2.5"):
        assert turns is None and why and "\n" not in why
        return
    template, ref = modelfile.go_template(turns), reference(d)
    for messages in CONVERSATIONS:
        expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert _ollama_render(template, turns.system, messages) == expected
    assert turns.system in ref.apply_chat_template(MESSAGES[:1], tokenize=False)


def test_bos_the_tokenizer_adds_is_left_out(tmp_path, llama_json_dir):
    """A template that starts with bos_token, for a tokenizer that prepends BOS itself: the TEMPLATE leaves it out,
    since llama.cpp adds it when it tokenizes the prompt."""
    d = tmp_path / "tok"
    d.mkdir()
    (d / "tokenizer.json").write_bytes((llama_json_dir / "tokenizer.json").read_bytes())
    cfg = json.loads((llama_json_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "{{ bos_token }}" + CHATML
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = tokenizer.Tokenizer(d)
    turns, why = modelfile.chat_turns(tok)
    assert why is None and tok.add_bos and turns.prefix == ""
    ref = reference(d)
    for messages in CONVERSATIONS:
        expected = ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ref.bos_token + _ollama_render(modelfile.go_template(turns), turns.system, messages) == expected


def test_modelfile_without_template_says_why(tmp_path, llama_json_dir, capsys):
    """Llama 2's template drops system messages: the Modelfile gets no TEMPLATE, a comment and one printed line."""
    src = _model_dir(tmp_path / "src", LLAMA | dict(num_hidden_layers=1), llama_json_dir)
    path = gguf_write.export_gguf(src, str(tmp_path / "m.gguf"), "f16")
    printed = capsys.readouterr().out.strip()
    text = open(modelfile.modelfile_path(path)).read()
    mf = _read_modelfile(text)
    assert mf["TEMPLATE"] is None and mf["SYSTEM"] is None and mf["FROM"] == "./m.gguf"
    assert "# no TEMPLATE: " in text and len(printed.splitlines()) == 1 and "no TEMPLATE" in printed
    assert mf["stop"] == [tokenizer.Tokenizer(src).special_tokens["eos_token"]]
