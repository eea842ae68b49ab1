"""What this file proves about generate.py: the converted SmolLM2-135M-Instruct, prompted through its own chat template,
answers a coding request greedily with Python that parses and runs, and the NF4-quantized base does too; an adapter
without --model runs on the base it names, where that base is here; --eval_task prints pass@1 of a problems file
instead of answering a prompt, and a missing file or a missing prompt is one line, and so is a kernel that cannot
confine the model's code (without --eval_task_unconfined); an answer's stop tokens are not printed, where the
tokenizer has several."""

import json
import re
import sys

import pytest
import torch
from conftest import fixed_outcome_problems

import generate
from support.data.tokenizer import Tokenizer
from support.evaluation import sandbox
from support.evaluation.sampling import generate_batch
from support.formats import gguf_read
from train import load_model


@pytest.mark.parametrize("quantize", [False, True])
def test_smollm2_writes_a_string_reverser(smollm2_dir, quantize):
    tok = Tokenizer(smollm2_dir)
    model = load_model(smollm2_dir, torch.float32, quantize=quantize).eval()
    ids = generate.chat_prompt(tok, "Write a Python function that reverses a string.")
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    answer = tok.decode(generate_batch(model, [ids], 40, eos_id=tok.eos_id)[0])
    code = re.search(r"^def .*?(?=\n\n|\n```|\Z)", answer, re.S | re.M)  # the first function of the answer
    assert code, answer
    namespace = {}
    exec(code.group(0), namespace)  # the model's own code, run on a real input
    funcs = [v for k, v in namespace.items() if callable(v) and not k.startswith("__")]
    assert funcs and funcs[0]("nanoqlora") == "arolqonan", answer


def test_an_adapter_runs_on_the_base_it_names(tmp_path):
    (base := tmp_path / "base").mkdir()
    (base / "config.json").write_text("{}")
    (adapter := tmp_path / "adapter").mkdir()
    for named, want in [(str(base), str(base)), (str(tmp_path / "gone"), gguf_read.smollm2_dir()), (None, None)]:
        (adapter / "adapter_config.json").write_text(json.dumps({"base_model_name_or_path": named}))
        assert generate.model_dir_for("", str(adapter)) == (want or gguf_read.smollm2_dir())
    assert generate.model_dir_for("mine", str(adapter)) == "mine"
    assert generate.model_dir_for("", "") == gguf_read.smollm2_dir()


def test_eval_task_prints_pass_at_1(tiny_dir, tmp_path, monkeypatch, capsys):
    """--eval_task with a 2-problem file (tests that pass and fail whatever is written) prints "pass@1: 50.0% (1/2
    problems)"; a missing file is one error line; neither a prompt nor --eval_task is a usage error. Where the kernel
    cannot confine the code (simulated) it is one error line naming --eval_task_unconfined, which then scores it."""
    problems = fixed_outcome_problems(tmp_path / "p.jsonl")
    monkeypatch.setattr("sys.argv", ["generate.py", "--model", tiny_dir, "--eval_task", str(problems),
                                     "--max_new_tokens", "4"])  # fmt: skip
    generate.main()
    assert capsys.readouterr().out.strip().endswith("p.jsonl pass@1: 50.0% (1/2 problems)")
    for argv, message in [(["--eval_task", "gone.jsonl"], "error: eval_task: gone.jsonl: no such file"), ([], "")]:
        monkeypatch.setattr("sys.argv", ["generate.py", "--model", tiny_dir, *argv])
        with pytest.raises(SystemExit) as e:
            generate.main()
        assert message in str(e.value.code) if message else e.value.code == 2
    monkeypatch.setattr(sandbox, "confinement", lambda: "Landlock is not in this kernel")
    monkeypatch.setattr("sys.argv", ["generate.py", "--model", tiny_dir, "--eval_task", str(problems)])
    with pytest.raises(SystemExit) as e:
        generate.main()
    assert e.value.code == (
        "error: eval_task: the kernel cannot confine the model's code (Landlock is not in this kernel); "
        "--eval_task_unconfined runs it under the Python guards alone"
    )
    monkeypatch.setattr("sys.argv", sys.argv + ["--eval_task_unconfined", "--max_new_tokens", "4"])
    generate.main()
    assert capsys.readouterr().out.strip().endswith("p.jsonl pass@1: 50.0% (1/2 problems)")


def test_no_stop_token_is_printed(tiny_dir, monkeypatch, capsys):
    """A tokenizer with two eos ids (as Llama 3's): the answer prints without either."""
    tok = Tokenizer(tiny_dir)
    stops = [tok.eos_id, tok.encode("!")[-1]]
    words = tok.encode(" hello")

    def tokenizer(model_dir):
        named = Tokenizer(model_dir)
        named.eos_id = stops
        return named

    monkeypatch.setattr(generate, "Tokenizer", tokenizer)
    monkeypatch.setattr(generate, "generate_batch", lambda *args, **kw: [[*words, stops[1], *words, stops[0]]])
    monkeypatch.setattr("sys.argv", ["generate.py", "--model", tiny_dir, "hi"])
    generate.main()
    assert capsys.readouterr().out == tok.decode(words + words) + "\n"
