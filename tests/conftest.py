"""Shared test set-up: the repository root on sys.path, fixed seeds, and the converted SmolLM2 checkpoint."""

import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


@pytest.fixture(scope="session")
def smollm2_dir():
    """The embedded default model (SmolLM2-135M-Instruct) as a HF-format directory, converted once from GGUF."""
    import convert

    return convert.smollm2_dir()
