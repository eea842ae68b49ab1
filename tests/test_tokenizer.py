"""tokenizer.py against transformers: token ids, decoding and rendered chat templates equal transformers' for the
tokenizers the tests train (a byte-level BPE tokenizer.json, a BPE-with-byte-fallback tokenizer.model) and for the
real SmolLM2 tokenizer; special ids, BOS policy and pad fallback agree too.
"""

import jinja2
import pytest
import transformers
from conftest import CONVERSATIONS, LLAMA2, TEXTS, corpus
from transformers.tokenization_utils_sentencepiece import SentencePieceBackend

from tokenizer import Tokenizer


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
