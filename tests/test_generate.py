"""What this file proves about generate.py: the converted SmolLM2-135M-Instruct, prompted through its own chat template,
answers a coding request greedily with Python that parses and runs, and the NF4-quantized base does too."""

import re

import pytest
import torch

import generate
from hf import load_model
from model import generate as model_generate
from tokenizer import Tokenizer


@pytest.mark.parametrize("quantize", [False, True])
def test_smollm2_writes_a_string_reverser(smollm2_dir, quantize):
    tok = Tokenizer(smollm2_dir)
    model = load_model(smollm2_dir, torch.float32, quantize=quantize).eval()
    ids = generate.chat_prompt(tok, "Write a Python function that reverses a string.")
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    answer = tok.decode(model_generate(model, ids, 40, eos_id=tok.eos_id))
    code = re.search(r"^def .*?(?=\n\n|\n```|\Z)", answer, re.S | re.M)  # the first function of the answer
    assert code, answer
    namespace = {}
    exec(code.group(0), namespace)  # the model's own code, run on a real input
    funcs = [v for k, v in namespace.items() if callable(v) and not k.startswith("__")]
    assert funcs and funcs[0]("nanoqlora") == "arolqonan", answer
