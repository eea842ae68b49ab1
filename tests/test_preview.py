"""support/data/preview.py: the data preview and its checks for the usual data bugs.

The default data (stdlib + SmolLM2) shows its answers marked and raises no warning over all of it; a double BOS (Llama-2
text passed through with a BOS-adding tokenizer), missing EOS (a base tokenizer under ChatML, also through train.py's
--preview report), merges across a cut (exactly where transformers' tokenizations of the joined and the
separate texts differ) and an example with nothing supervised are each flagged.
"""

import re
from functools import partial
from types import SimpleNamespace

from conftest import DATA, reference
from test_pack import tokenize_examples

from pack import build_dataset
from support.data.examples import read_examples, stdlib_examples
from support.data.preview import check_examples, preview
from support.data.tokenizer import Tokenizer
from support.run.progress import data_report


def test_preview_default_data(smollm2_dir):
    """The stdlib dataset with SmolLM2: each shown example's marked text is its answer as ChatML renders it, and the
    whole dataset (train and val) raises no warning."""
    tok, examples = Tokenizer(smollm2_dir), stdlib_examples()
    text = preview(examples, tok, n=3)  # pytest captures stdout: not a terminal, so brackets
    print(text)
    assert text.count("\n--- ") == 3 and text.endswith("no warnings in the 3 examples shown")
    assert all(f"\n--- {ex['name']}: " in text for ex in examples[:3])  # each named by its function
    assert "EOS '<|im_end|>'" in text.splitlines()[0] and text.count("⟦") == 1 + 3  # the legend, one per example
    for ex in examples[:3]:
        assert f"{ex['instruction']}<|im_end|>\n<|im_start|>assistant\n⟦{ex['response']}<|im_end|>⟧\n" in text
    colored = preview(examples, tok, n=1, color=True)
    assert f"\x1b[32m{examples[0]['response']}<|im_end|>\x1b[0m" in colored and "⟦" not in colored
    assert check_examples(examples + stdlib_examples("val"), tok) == []


def test_preview_flags_double_bos(sp_dir):
    """Llama-2 data exported with its "<s>" and passed through as it is, with a tokenizer that prepends BOS."""
    tok, ref = Tokenizer(sp_dir), reference(sp_dir)
    examples = list(read_examples(DATA / "llama2_preformatted.jsonl"))
    text = preview(examples, tok, template="{instruction}{response}")
    tokens, _, offsets = tokenize_examples(examples, tok, template="{instruction}{response}")
    for i, ex in enumerate(examples):
        assert tok.add_bos and ref.encode(ex["instruction"], add_special_tokens=False)[0] == ref.bos_token_id
        assert tokens[offsets[i] : offsets[i] + 2].tolist() == [ref.bos_token_id] * 2
        assert f"warning: {DATA / 'llama2_preformatted.jsonl'}:{i + 1}: double BOS '<s><s>'" in text
    clean = [{"instruction": ex["instruction"][3:], "response": ex["response"]} for ex in examples]
    assert "double BOS" not in preview(clean, tok, template="{instruction}{response}")


def test_preview_flags_missing_eos(tmp_path, family_dirs, capsys):
    """A base model's tokenizer (eos <|endoftext|>) under the instruct model's ChatML template: no assistant turn
    ends with EOS, so the model would never learn to stop. The instruct tokenizer (eos <|im_end|>) is clean."""
    examples = list(read_examples(DATA / "chat.jsonl"))
    turns = sum(m["role"] == "assistant" for ex in examples for m in ex["messages"])
    base = family_dirs["qwen2.5-base"]
    ref = reference(base)
    for ex in examples:  # transformers' own tokenization of the conversation holds no EOS either
        assert ref.eos_token_id not in ref.apply_chat_template(ex["messages"], tokenize=True)["input_ids"]
    text = preview(examples, Tokenizer(base), n=len(examples))
    lines = re.findall(r"warning: .*chat\.jsonl:\d: response \d ends with '.*', not EOS '<\|endoftext\|>': .*", text)
    assert len(lines) == turns and len(text.split("warning:")) == turns + 1
    cfg = SimpleNamespace(preview=True, data_format="auto", skip_bad_rows=False, template="", train_on_prompt=False)
    trainset = build_dataset(examples, Tokenizer(base), 64, cache_dir=tmp_path / "cache")
    data_report(cfg, trainset, [DATA / "chat.jsonl"], Tokenizer(base))  # train.py --preview: the file read again
    out = capsys.readouterr().out
    assert re.findall(r"warning: .*", out) == lines + lines and f"{turns} warning(s) over all 3 training" in out
    instruct = preview(examples, Tokenizer(family_dirs["qwen2.5"]), n=len(examples))
    assert instruct.endswith("no warnings in the 3 examples shown")


def test_preview_flags_merges_and_unsupervised(bpe_dir, smollm2_dir):
    """A format whose prompt ends with a space: warned exactly where transformers tokenizes the joined text
    differently from prompt and response apart. ShareGPT roles (no "assistant"): nothing supervised."""
    tok, ref = Tokenizer(bpe_dir), reference(bpe_dir)
    fmt = "Q: {instruction}\nA: {response}"
    examples = [{"instruction": "Add.", "response": r} for r in ["return x", "\nreturn x", "42", "(a, b)", " x"]]
    text = preview(examples, tok, template=fmt, n=len(examples))
    merged = []
    for i, ex in enumerate(examples):
        head, enc = (
            fmt.format(instruction=ex["instruction"], response=""),
            partial(ref.encode, add_special_tokens=False),
        )
        merged.append(enc(head + ex["response"]) != enc(head) + enc(ex["response"]))
        assert (f"warning: example {i}: tokens merge across the cut 'Q: Add.\\nA: ' | " in text) == merged[-1]
    assert any(merged) and not all(merged)
    sharegpt = [{"messages": [{"role": "human", "content": "Hi"}, {"role": "gpt", "content": "Hello"}]}]
    assert "warning: example 0: no supervised token" in preview(sharegpt, Tokenizer(smollm2_dir))
    assert "no supervised" not in preview(sharegpt, Tokenizer(smollm2_dir), train_on_prompt=True)
