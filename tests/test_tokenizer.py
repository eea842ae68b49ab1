"""tokenizer.py against transformers: token ids, decoding and rendered chat templates equal transformers' for the
tokenizers the tests train (a byte-level BPE tokenizer.json, a BPE-with-byte-fallback tokenizer.model) and for the
real SmolLM2 tokenizer; special ids, BOS policy and pad fallback agree too. The published Qwen2.5, Qwen3 and Mistral
(v0.1, v0.3, legacy) templates and a Llama-3-style one render as transformers renders them (or refuse the same
conversations with the same error), and `render` gives transformers' generation prompt and the final turn as the
template renders it (Qwen3's with its empty think block); for a plain format string, one instance per turn.
"""

import re

import jinja2
import pytest
import transformers
from conftest import CONVERSATIONS, FAMILIES, LLAMA2, TEXTS, corpus, reference, turn_text
from transformers.tokenization_utils_sentencepiece import SentencePieceBackend

from support.data.tokenizer import Tokenizer, render

SYSTEM = {"role": "system", "content": "Answer tersely & <exactly>."}
RENDERED = [CONVERSATIONS[0], [SYSTEM, *CONVERSATIONS[0]], CONVERSATIONS[1][1:], CONVERSATIONS[1]]


def test_tokenizer_json_matches_transformers(bpe_dir, llama_json_dir):
    ours, ref = Tokenizer(bpe_dir), transformers.AutoTokenizer.from_pretrained(str(bpe_dir))
    for text in TEXTS + corpus():
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == ref.decode(ids) == text
    assert ours.encode("a b", bos=True, eos=True) == [
        ref.bos_token_id,
        *ref.encode("a b", add_special_tokens=False),
        ref.eos_token_id,
    ]
    assert (ours.bos_id, ours.eos_id, ours.pad_id, ours.vocab_size) == (
        ref.bos_token_id,
        ref.eos_token_id,
        ref.pad_token_id,
        len(ref),
    )
    assert not ours.add_bos  # this tokenizer never adds BOS by itself ...
    llama, llama_ref = Tokenizer(llama_json_dir), transformers.AutoTokenizer.from_pretrained(str(llama_json_dir))
    assert llama.add_bos and llama.encode("a b", bos=llama.add_bos) == llama_ref.encode("a b")  # ... this one does
    assert llama.pad_id == llama.eos_id  # no pad token: pad with EOS


def test_sentencepiece_matches_transformers(sp_dir):
    """transformers cannot load a .model without protobuf here, so its sentencepiece tokenizer class is built directly
    (legacy mode: the sentencepiece behaviour of the original Llama tokenizers)."""
    ours = Tokenizer(sp_dir)
    ref = SentencePieceBackend(
        vocab_file=str(sp_dir / "tokenizer.model"),
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
    )
    for text in TEXTS + corpus():
        ids = ours.encode(text)
        assert ids == ref.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == text
    assert (ours.bos_id, ours.eos_id, ours.pad_id, ours.vocab_size) == (
        ref.bos_token_id,
        ref.eos_token_id,
        ref.pad_token_id,
        len(ref),
    )
    assert ours.decode([1000, *ours.encode("x")]) == "<pad>x"
    for msgs in CONVERSATIONS:
        assert ours.apply_chat_template(msgs) == ref.apply_chat_template(msgs, chat_template=LLAMA2, tokenize=False)


@pytest.mark.parametrize("generation", [False, True])
def test_chat_template_matches_transformers(bpe_dir, generation):
    ours, ref = Tokenizer(bpe_dir), transformers.AutoTokenizer.from_pretrained(str(bpe_dir))
    for msgs in CONVERSATIONS + [c[:-1] for c in CONVERSATIONS]:
        text = ref.apply_chat_template(msgs, add_generation_prompt=generation, tokenize=False)
        assert ours.apply_chat_template(msgs, add_generation_prompt=generation) == text
    assert '"<b>O\'Neil & co</b>"' in ours.apply_chat_template(CONVERSATIONS[1])  # tojson does not HTML-escape
    with pytest.raises(jinja2.exceptions.TemplateError, match="unknown role tool"):
        ours.apply_chat_template([{"role": "tool", "content": "x"}])


def test_smollm2_tokenizer_matches_transformers(smollm2_dir):
    ours, ref = Tokenizer(smollm2_dir), transformers.AutoTokenizer.from_pretrained(smollm2_dir)
    for text in TEXTS + corpus():
        assert ours.encode(text) == ref.encode(text, add_special_tokens=False), text
    for msgs in CONVERSATIONS:
        for g in (False, True):
            assert ours.apply_chat_template(msgs, g) == ref.apply_chat_template(
                msgs, add_generation_prompt=g, tokenize=False
            )
    assert (ours.bos_id, ours.eos_id, ours.vocab_size) == (ref.bos_token_id, ref.eos_token_id, len(ref))


@pytest.mark.parametrize("family", [*FAMILIES, "llama3-style"])
def test_family_templates_match_transformers(family_dirs, family):
    """Single- and multi-turn conversations, with and without a system message, whole or cut before the last answer,
    with and without a generation prompt."""
    ours, ref = Tokenizer(family_dirs[family]), reference(family_dirs[family])
    rendered = 0
    for msgs in RENDERED:
        for cut, generation in ((msgs, False), (msgs, True), (msgs[:-1], True), (msgs[:-1], False)):
            kw = dict(chat_template=ours.chat_template, tokenize=False, add_generation_prompt=generation)
            try:
                want = ref.apply_chat_template(cut, **kw)
            except jinja2.TemplateError as e:
                with pytest.raises(jinja2.TemplateError, match=re.escape(str(e))):
                    ours.apply_chat_template(cut, generation)
                continue
            assert ours.apply_chat_template(cut, generation) == want, (cut, generation)
            rendered += 1
    assert rendered == (8 if family == "mistral-legacy" else 16)  # the legacy template refuses a system message


@pytest.mark.parametrize("family", [*FAMILIES, "llama3-style"])
def test_render_gives_the_generation_prompt(family_dirs, family):
    ours, ref = Tokenizer(family_dirs[family]), reference(family_dirs[family])
    msgs = CONVERSATIONS[1][1:]
    prompt, response, bos = render({"messages": msgs}, ours)
    kw = dict(chat_template=ours.chat_template, tokenize=False)
    assert prompt == ref.apply_chat_template(msgs[:-1], add_generation_prompt=True, **kw) and not bos
    turn = turn_text(family, msgs, len(msgs) - 1)  # the final turn as the template renders it, end of turn included
    assert ref.apply_chat_template(msgs, **kw).startswith(prompt + turn) and response == turn.removesuffix(
        ref.eos_token
    )
    if family == "qwen3":  # not the raw content: Qwen3's final turn carries an empty think block
        assert response == "<think>\n\n</think>\n\n" + msgs[-1]["content"]


def test_render_plain_format(llama_json_dir, bpe_dir):
    """One format instance per assistant turn, the system message before the first instruction, EOS between
    instances; BOS as the tokenizer adds it to plain text."""
    fmt = "Q: {instruction}\nA: {response}"
    system, u1, a1, u2, a2 = (m["content"] for m in CONVERSATIONS[1])
    for d in (llama_json_dir, bpe_dir):
        tok, ref = Tokenizer(d), reference(d)
        prompt, response, bos = render({"messages": CONVERSATIONS[1]}, tok, fmt)
        first = fmt.format(instruction=f"{system}\n\n{u1}", response=a1)
        assert prompt == first + ref.eos_token + fmt.format(instruction=u2, response="") and response == a2
        assert bos == (ref.encode("x")[:1] == [ref.bos_token_id])
        pair = render({"instruction": u1, "response": a1}, tok, fmt)
        assert pair == (fmt.format(instruction=u1, response=""), a1, bos)
