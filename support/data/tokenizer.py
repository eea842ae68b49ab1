"""Tokenizers and chat templates: text to token ids, and conversations to the text a chat model expects.

`Tokenizer(dir)` reads a Hugging Face tokenizer directory: tokenizer.json (`tokenizers`) or tokenizer.model
(`sentencepiece`, cut at special-token strings as transformers' legacy=True), with tokenizer_config.json's special
tokens and chat template, rendered as transformers renders it. `segments` cuts an example's document into
(text, supervised) pieces: every assistant turn, end-of-turn token included, is supervised, the rest is prompt; the cuts
come from rendering prefixes of the conversation, so any template works. A plain format string with {instruction} and
{response} renders one instance per assistant turn, with EOS after each response.
"""

import json
import os
import re
from datetime import datetime
from pathlib import Path

from jinja2 import TemplateError

from support.formats.atomic import read_json

DEFAULT_TEMPLATE = "### Instruction:\n{instruction}\n\n### Response:\n{response}"
SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _token_str(v):
    return v.get("content") if isinstance(v, dict) else v  # tokenizer_config stores AddedToken as a dict


def _compile_chat_template(source):
    """The template as transformers compiles it: sandboxed, trim_blocks and lstrip_blocks, loopcontrols."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson HTML-escapes <, > and &, which would change the prompt text.
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env.from_string(source)


class Tokenizer:
    """tokenizer.json or tokenizer.model behind encode/decode, special ids and the chat template."""

    def __init__(self, path):
        self.path = d = Path(path) if Path(path).is_dir() else Path(path).parent
        cfg_file = d / "tokenizer_config.json"
        cfg = read_json(cfg_file) if cfg_file.exists() else {}
        self.special_tokens = {k: _token_str(cfg[k]) for k in SPECIAL_NAMES if cfg.get(k)}
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
            template = {t["name"]: t["template"] for t in template}.get("default")
        if template is None and (d / "chat_template.jinja").exists():
            template = (d / "chat_template.jinja").read_text()
        self.chat_template, self._compiled = template, None
        self.encode_threads = -1  # sentencepiece's batched encode: -1, every core (tokenizer.json's: its own setting)
        if (d / "tokenizer.json").exists():
            import tokenizers

            self.files, self._sp = [d / "tokenizer.json"], None
            self._tok = tokenizers.Tokenizer.from_file(str(self.files[0]))
            self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
            ids = {s: self._tok.token_to_id(s) for s in self.special_tokens.values()}
        elif (d / "tokenizer.model").exists():
            import sentencepiece

            self.files, self._tok = [d / "tokenizer.model"], None
            self._sp = sp = sentencepiece.SentencePieceProcessor(model_file=str(self.files[0]))
            for name, i in (("bos_token", sp.bos_id()), ("eos_token", sp.eos_id()), ("unk_token", sp.unk_id())):
                if i >= 0:  # a bare .model still names its own specials
                    self.special_tokens.setdefault(name, sp.id_to_piece(i))
            n = sp.get_piece_size()
            ids = {
                s: i for s in self.special_tokens.values() if (i := sp.piece_to_id(s)) < n and sp.id_to_piece(i) == s
            }
            ids |= {_token_str(t): int(i) for i, t in cfg.get("added_tokens_decoder", {}).items()}
            self._special, self._special_of = ids, {i: s for s, i in ids.items()}
            self._split = re.compile("(" + "|".join(map(re.escape, sorted(ids, key=len, reverse=True))) + ")")
            self.vocab_size = max([n - 1, *ids.values()]) + 1
        else:
            raise FileNotFoundError(f"{d}: no tokenizer.json or tokenizer.model")
        self.files += [f for f in (cfg_file, d / "chat_template.jinja") if f.exists()]
        self.bos_id, self.eos_id, pad = (ids.get(self.special_tokens.get(f"{k}_token")) for k in ("bos", "eos", "pad"))
        self.pad_id = pad if pad is not None else self.eos_id
        # Whether plain (non-chat) prompts start with BOS: the config says so, else what the tokenizer does by itself.
        default = self._sp is not None or self._tok.encode("a").ids[:1] == [self.bos_id]
        self.add_bos = self.bos_id is not None and bool(cfg.get("add_bos_token", default))

    def encode_batch(self, texts):
        """Token ids of many texts without BOS/EOS; both libraries encode a list in parallel native threads."""
        if self._sp is None:
            return [e.ids for e in self._tok.encode_batch_fast(list(texts), add_special_tokens=False)]
        parts = [[p for p in self._split.split(t) if p] if self._special else [t] for t in texts]
        pieces = [p for ps in parts for p in ps if p not in self._special]  # the text between special tokens
        plain = iter(self._sp.encode(pieces, num_threads=self.encode_threads))
        return [[i for p in ps for i in ([self._special[p]] if p in self._special else next(plain))] for ps in parts]

    def encode(self, text, bos=False, eos=False):
        return [self.bos_id] * bos + self.encode_batch([text])[0] + [self.eos_id] * eos

    def decode(self, ids):
        if self._sp is None:
            return self._tok.decode(list(ids), skip_special_tokens=False)
        out, run = [], []
        for i in ids:  # sentencepiece drops control pieces and knows no added ids: those are spelled out here
            if i in self._special_of:
                out += [self._sp.decode(run), self._special_of[i]]
                run = []
            else:
                run.append(i)
        return "".join(out) + self._sp.decode(run)

    def apply_chat_template(self, messages, add_generation_prompt=False):
        if self.chat_template is None:
            raise ValueError(f"{self.path}: the tokenizer has no chat_template")
        self._compiled = self._compiled or _compile_chat_template(self.chat_template)
        kw = dict(messages=messages, tools=None, documents=None, add_generation_prompt=add_generation_prompt)
        return self._compiled.render(**kw, **self.special_tokens)


def _plain_pieces(ex, template):
    """[(text, supervised)] of a plain format string: one instance per assistant turn."""
    head, _, tail = template.partition("{response}")
    if tail or "{instruction}" not in head:
        raise ValueError(f"template must contain {{instruction}} and end with {{response}}: {template!r}")
    if "messages" not in ex:
        return [(head.replace("{instruction}", ex["instruction"]), False), (ex["response"], True)]
    pieces, said = [], []  # said: the system/user contents since the last assistant turn
    for m in ex["messages"]:
        if m["role"] != "assistant":
            said.append(m["content"])
            continue
        pieces += [(head.replace("{instruction}", "\n\n".join(said)), False), (m["content"], True)]
        said = []
    return pieces


def _chat_pieces(msgs, tok):
    """[(text, supervised)] of the whole render, cut around every assistant turn found by rendering prefixes."""
    whole, eos = tok.apply_chat_template(msgs), tok.special_tokens.get("eos_token")
    turns = [k for k, m in enumerate(msgs) if m["role"] == "assistant"]
    starts, pieces, cur = [], [], 0
    for k in turns:
        prefix = tok.apply_chat_template(msgs[:k], add_generation_prompt=True)
        if not whole.startswith(prefix):
            i = len(os.path.commonprefix([prefix, whole]))
            raise ValueError(
                f"chat template: messages[:{k}] rendered with add_generation_prompt=True is not a prefix of the whole "
                f"conversation ({prefix[i : i + 30]!r} vs {whole[i : i + 30]!r}), so assistant turn {k} cannot be "
                "masked: the template renders earlier turns differently depending on what follows"
            )
        starts.append(len(prefix))
    for j, (k, s) in enumerate(zip(turns, starts, strict=True)):
        bound = starts[j + 1] if j + 1 < len(turns) else len(whole)
        # An answer quoting the eos text does not end there: look for the eos after the answer's own text, if the
        # answer is rendered verbatim in its own turn (found before the first eos; not in a later message quoting it)
        first = whole.find(eos, s, bound) if eos else -1
        c = whole.find(content := msgs[k]["content"].strip(), s, bound)
        e = whole.find(eos, c + len(content), bound) if 0 <= c <= first else first
        end = e + len(eos) if e >= 0 else bound
        if e < 0 and j + 1 < len(turns):  # no end-of-turn token: the turn ends where the next one starts
            end = len(upto := tok.apply_chat_template(msgs[: k + 1]))
            if not (whole.startswith(upto) and s <= end <= bound):
                raise ValueError(
                    f"chat template: assistant turn {k} renders no eos {eos!r} and the conversation ending with it "
                    "is not a prefix of the whole, so the end of the turn cannot be found"
                )
        pieces += [(whole[cur:s], False), (whole[s:end], True)]
        cur = end
    return [*pieces, (whole[cur:], False)]


def segments(ex, tok, template=None):
    """The document of one example cut into pieces: ([(text, supervised), ...], prepend BOS?, append EOS after each
    supervised piece?). `template` is a plain format string, or None for the tokenizer's chat template."""
    if template is not None or tok.chat_template is None:
        return _plain_pieces(ex, template or DEFAULT_TEMPLATE), tok.add_bos, True
    msgs = ex.get("messages") or [
        {"role": "user", "content": ex["instruction"]},
        {"role": "assistant", "content": ex["response"]},
    ]
    return _chat_pieces(msgs, tok), False, False


def render(ex, tok, template=None):
    """(prompt text, final response text, prepend BOS?) to generate the last assistant turn from: the prompt is
    everything the document holds before that turn, the response is its text without the end-of-turn token."""
    pieces, bos, add_eos = segments(ex, tok, template)
    eos = tok.special_tokens.get("eos_token") or ""
    last = max(i for i, (_, supervised) in enumerate(pieces) if supervised)
    prompt = "".join(t + eos * (s and add_eos) for t, s in pieces[:last])
    response = pieces[last][0]
    return prompt, response.removesuffix(eos) if eos and not add_eos else response, bos


def segment(examples, tokenizer, template, first=0, skip_bad_rows=False):
    """([(index, label, segmented)], skipped): `segments` of each example, numbered from `first`, and "label: why" of
    each example the template rejects, which stops the run unless skip_bad_rows."""
    segmented, skipped = [], []
    for i, ex in enumerate(examples, first):
        label = ex.get("source") or ex.get("name") or f"example {i}"  # file:line, stdlib function, or position
        try:
            segmented.append((i, label, segments(ex, tokenizer, template)))
        except (ValueError, TemplateError) as e:
            if not skip_bad_rows:
                raise ValueError(f"{label}: {e}") from None
            skipped.append(f"{label}: {e}")
    return segmented, skipped


def renders(ex, tokenizer, template=None):
    """Whether the template renders example `ex` (what skip_bad_rows keeps)."""
    return bool(segment([ex], tokenizer, template, skip_bad_rows=True)[0])
