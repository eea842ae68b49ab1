"""How does a GGUF get an Ollama Modelfile? OUT.gguf -> OUT.Modelfile: FROM the file, a Go TEMPLATE and SYSTEM derived
from the jinja chat template, and the stop tokens.

The template is derived by rendering the chat template around marker contents and checked against renders of ordinary
conversations; where they differ, no TEMPLATE is written, the Modelfile says why, and Ollama uses the GGUF's template.
"""

import copy
import os
from pathlib import Path
from typing import NamedTuple

from support.formats import atomic

# Marker contents for the chat-template derivation: plain words no template rewrites, each found exactly once.
MARKS = {k: f"MARK{k}q7" for k in ("S", "U1", "A1", "U2", "A2", "BOS")}
# Ordinary contents (whitespace at the ends, a newline, quotes) that the derived template must reproduce.
CHECK_TEXTS = ("  Be brief.\n", 'Say "hi"\n\nplease ', " Hi! ", "  x = 1\n", "ok")
GO_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}  # in a Go string literal


def modelfile_path(gguf_path):
    """Where export_gguf puts the Ollama Modelfile for `gguf_path`: OUT.gguf -> OUT.Modelfile."""
    return os.path.splitext(os.fspath(gguf_path))[0] + ".Modelfile"


class ChatTurns(NamedTuple):
    """A chat template as fixed text around each message: prefix, then per message pre[role] + content +
    suf[role] (no suffix after a final assistant message), then pre["assistant"] to prompt a reply."""

    prefix: str  # once, before the first message (e.g. BOS)
    system: str | None  # the default system prompt the template injects when there is no system message
    pre: dict  # role -> text before the content
    suf: dict  # role -> text after the content


class NoTemplate(Exception):
    """The chat template cannot be written as an Ollama TEMPLATE; the message says why."""


def _msg(role, content):
    return {"role": role, "content": content}


def _conversation(contents):
    roles = ("system", "user", "assistant", "user", "assistant")
    return [_msg(r, c) for r, c in zip(roles, contents, strict=True)]


def _render(tok, messages, gen):
    try:
        return tok.apply_chat_template(messages, add_generation_prompt=gen)
    except Exception as e:  # a chat template is arbitrary code: whatever it raises is the reason, reported in one line
        first = str(e).splitlines()[0] if str(e) else ""
        raise NoTemplate(f"the template raises {type(e).__name__}: {first}") from None


def _split(text, marks):
    """The text before, between and after `marks`, each of which must occur once, in this order."""
    pieces, pos = [], 0
    for mark in marks:
        i = text.find(mark, pos)
        if i < 0 or text.count(mark) != 1:
            raise NoTemplate("the template does not render every message content once, verbatim and in order")
        pieces.append(text[pos:i])
        pos = i + len(mark)
    return [*pieces, text[pos:]]


def _derive(tok):
    """ChatTurns from the text between the markers of a few renders."""
    marks = [MARKS[k] for k in ("S", "U1", "A1", "U2", "A2")]
    S, U1, A1, _, _ = conv = _conversation(marks)
    g0, g1, g2, g3, g4, tail = _split(_render(tok, conv, False), marks)
    prompt, without = _render(tok, [S, U1], True), _render(tok, [S, U1], False)
    if not prompt.startswith(without):
        raise NoTemplate("the generation prompt is not text appended to the conversation")
    pre_a = prompt[len(without) :]
    if g2 != g4 or not g2.endswith(pre_a):
        raise NoTemplate("the two exchanges of one conversation render differently")
    suf_a = os.path.commonprefix([tail, g3])  # the conversation's tail may add a trailer after the last turn
    pre_u = g3[len(suf_a) :]
    head = _split(_render(tok, [U1, A1], False), marks[1:3])[0]
    if not (g1.endswith(pre_u) and head.endswith(pre_u)):
        raise NoTemplate("the first user turn renders differently from the second")
    suf_s, head = g1[: len(g1) - len(pre_u)], head[: len(head) - len(pre_u)]
    if g0.startswith(head):  # nothing injected: the head is a fixed prefix such as BOS
        prefix, system = head, None
    elif head.startswith(g0) and head.endswith(suf_s) and len(head) > len(g0) + len(suf_s):
        prefix, system = MARKS["BOS"] if g0.startswith(MARKS["BOS"]) else "", head[len(g0) : len(head) - len(suf_s)]
    else:
        raise NoTemplate("the text before the first user turn is neither a fixed prefix nor a default system prompt")
    pre = {"system": g0[len(prefix) :], "user": pre_u, "assistant": pre_a}
    return ChatTurns(prefix, system, pre, {"system": suf_s, "user": g2[: len(g2) - len(pre_a)], "assistant": suf_a})


def render_turns(turns, messages):
    """What the TEMPLATE of `turns` renders for `messages`, SYSTEM included as Ollama adds it, prompting for a reply
    unless the last message is the assistant's."""
    if turns.system is not None and all(m["role"] != "system" for m in messages):
        messages = [_msg("system", turns.system), *messages]
    out = turns.prefix
    for i, m in enumerate(messages):
        last = i == len(messages) - 1
        out += turns.pre[m["role"]] + m["content"]
        out += "" if last and m["role"] == "assistant" else turns.suf[m["role"]]
        out += turns.pre["assistant"] if last and m["role"] != "assistant" else ""
    return out


def _check(tok, turns):
    """The derived turns must reproduce the template on conversations with ordinary contents."""
    S, U1, A1, U2, A2 = conv = _conversation(CHECK_TEXTS)
    for messages in ([U1], [S, U1], [U1, A1, U2], [S, U1, A1, U2]):
        if render_turns(turns, messages) != _render(tok, messages, True):
            raise NoTemplate("ordinary contents render differently (the template rewrites contents or varies turns)")
    if render_turns(turns, conv) + turns.suf["assistant"] != _render(tok, conv, False):
        raise NoTemplate("a conversation ending with the assistant renders differently")
    if turns.system and ('"""' in turns.system or turns.system[:1] == '"' or turns.system[-1:] == '"'):
        raise NoTemplate("the default system prompt cannot be quoted in a Modelfile")
    if turns.system and not all(c.isprintable() or c in "\n\t" for c in turns.system):
        raise NoTemplate("the default system prompt holds characters Ollama's parser drops")


def chat_turns(tok):
    """(ChatTurns, None) for a tokenizer.Tokenizer's chat template, or (None, why not). BOS is rendered as a marker
    so that a BOS the tokenizer adds by itself (as llama.cpp does) can be left out of the prefix."""
    if not tok.chat_template:
        return None, "the tokenizer has no chat template"
    bos = tok.special_tokens.get("bos_token")
    marked = copy.copy(tok)
    marked.special_tokens = {**tok.special_tokens, **({"bos_token": MARKS["BOS"]} if bos else {})}
    try:
        turns = _derive(marked)
        _check(marked, turns)
    except NoTemplate as e:
        return None, str(e)
    real = lambda s: s.replace(MARKS["BOS"], bos or "")  # noqa: E731
    prefix = "" if turns.prefix == MARKS["BOS"] and tok.add_bos else real(turns.prefix)
    pre, suf = ({role: real(s) for role, s in d.items()} for d in (turns.pre, turns.suf))
    return ChatTurns(prefix, turns.system, pre, suf), None


def _go(s):
    """A Go template action printing `s`, in pure ASCII: Ollama's parser drops unprintable characters, and `{{-`
    trimming would eat newlines that belong to the turns."""
    out = []
    for ch in s:
        if ch in GO_ESCAPES:
            out.append(GO_ESCAPES[ch])
        elif " " <= ch <= "~":
            out.append(ch)
        else:
            out.append(f"\\u{ord(ch):04x}" if ord(ch) < 0x10000 else f"\\U{ord(ch):08x}")
    return '{{ "' + "".join(out) + '" }}' if s else ""


def go_template(turns):
    """The Ollama TEMPLATE for `turns`, over .Messages. Every line after the first opens with `{{-`, which eats the
    newline before it, so the layout adds no text."""
    pre, suf = turns.pre, turns.suf
    return "\n".join(
        [
            _go(turns.prefix) + "{{- range $i, $m := .Messages }}",
            "{{- $last := eq (len (slice $.Messages $i)) 1 }}",
            '{{- if eq $m.Role "system" }}' + _go(pre["system"]) + "{{ $m.Content }}" + _go(suf["system"]),
            '{{- else if eq $m.Role "user" }}' + _go(pre["user"]) + "{{ $m.Content }}" + _go(suf["user"]),
            '{{- else if eq $m.Role "assistant" }}' + _go(pre["assistant"]) + "{{ $m.Content }}",
            "{{- if not $last }}" + _go(suf["assistant"]) + "{{ end }}",
            "{{- end }}",
            '{{- if and $last (ne $m.Role "assistant") }}' + _go(pre["assistant"]) + "{{ end }}",
            "{{- end }}",
        ]
    )


def _stops(vocab, turns):
    """The special tokens that end an assistant turn or open the next user turn, in order, then eos."""
    text = turns.suf["assistant"] + turns.pre["user"] if turns else ""
    found = [t for _, t in sorted((text.find(t), t) for t in vocab.specials if t in text)]
    eos = vocab.ids["eos"]
    found += [vocab.tokens[eos]] if eos is not None else []
    return [t for t in dict.fromkeys(found) if t.isprintable() and '"' not in t]


def write_modelfile(gguf_path, vocab):
    """Write the Ollama Modelfile for `gguf_path`; without a usable TEMPLATE, say why in one line. Returns its path."""
    path = modelfile_path(gguf_path)
    turns, why = chat_turns(vocab.tok)
    name = os.path.basename(gguf_path)
    lines = [f'FROM "./{name}"' if any(c.isspace() for c in name) else f"FROM ./{name}"]
    if turns is None:
        print(f"{path}: no TEMPLATE written: {why}; Ollama will use the chat template stored in the GGUF")
        lines.append(f"# no TEMPLATE: {why}")
    else:
        lines.append(f'TEMPLATE """{go_template(turns)}"""')
        lines += [f'SYSTEM """{turns.system}"""'] if turns.system else []
    lines += [f'PARAMETER stop "{t}"' for t in _stops(vocab, turns)]
    atomic.atomic_write(path, lambda tmp: Path(tmp).write_text("\n".join(lines) + "\n"))
    return path
