"""What this file proves about bench.py's training comparison (nothing here is timed):

- the peer (transformers + PEFT) trains on exactly the token tensors train.py trains on: for the equal-work file and
  for the stdlib dataset one example per row, bench.peer_dataset(...).step_batch equals train.build_data(...)'s
  step_batch tensor for tensor, step after step and across the epoch boundary;
- every row of the equal-work file is a full 512-token row with all 511 targets supervised, so neither side pads;
- bench.hf_batch turns our pre-shifted labels and per-document position ids into inputs on which transformers'
  LlamaForCausalLM computes our loss: its mean cross-entropy on a padded batch equals our Llama's summed loss over
  the supervised-token count (a small random model, fp32).
"""

import json

import pytest
import torch
import transformers
from safetensors.torch import save_file

import bench
import train
from hf import read_config
from model import Llama, LlamaConfig
from tokenizer import Tokenizer


@pytest.fixture(scope="module")
def setup(smollm2_dir, tmp_path_factory):
    """(tokenizer, cache dir, equal-work JSONL) shared by the tests: the stdlib dataset is tokenized once."""
    tmp = tmp_path_factory.mktemp("bench")
    tok, cache = Tokenizer(smollm2_dir), str(tmp / "cache")
    path = str(tmp / "padded.jsonl")
    bench.write_padded_jsonl(path, tok, cache_dir=cache)
    return tok, cache, path, read_config(smollm2_dir)[0]


def train_batches(cfg, tok, steps):
    trainset, _, _ = train.build_data(cfg, tok, 8192, master=True)
    rows = cfg.batch_tokens // trainset.context_length
    return [trainset.step_batch(s, rows) for s in steps]


@pytest.mark.parametrize("workload", ["padded", "stdlib"])
def test_peer_sees_train_py_tensors(setup, workload):
    tok, cache, path, _ = setup
    data = path if workload == "padded" else ""
    cfg = train.Config(
        data=data,
        val_data=data,
        pack=False,
        train_on_prompt=bool(data),
        context_length=bench.CONTEXT,
        batch_tokens=bench.ROWS * bench.CONTEXT,
        seed=bench.SEED,
        cache_dir=cache,
    )
    ds = bench.peer_dataset(data, tok, bool(data), cache_dir=cache)
    steps = [0, 1, 2, ds.steps_per_epoch(bench.ROWS) + 1]  # the last one is in the second epoch
    for step, ours in zip(steps, train_batches(cfg, tok, steps), strict=True):
        peer = ds.step_batch(step, bench.ROWS)
        assert peer.keys() == ours.keys()
        for k in ours:
            assert torch.equal(peer[k], ours[k]), (workload, step, k)
        if workload == "padded":
            assert peer["input_ids"].shape == (bench.ROWS, bench.CONTEXT)
            assert int((peer["labels"] != -100).sum()) == bench.ROWS * (bench.CONTEXT - 1)


def test_hf_batch_gives_our_loss(setup, tmp_path):
    tok, cache, _, smollm2 = setup
    small = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, head_dim=16)
    cfg = LlamaConfig.from_hf({**smollm2.to_hf(), **small, "num_key_value_heads": 2})  # SmolLM2's vocab, RoPE, ties
    model = Llama(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    save_file({k: v for k, v in model.state_dict().items() if k != "lm_head.weight"}, tmp_path / "model.safetensors")
    json.dump(cfg.to_hf(), open(tmp_path / "config.json", "w"))
    ref = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()

    batch = bench.peer_dataset("", tok, False, cache_dir=cache).step_batch(0, bench.ROWS)
    inputs = bench.hf_batch(batch)
    assert (inputs["attention_mask"] == 0).any(), "the batch should hold padding"
    with torch.no_grad():
        loss_sum, n = model(batch["input_ids"], batch["position_ids"], labels=batch["labels"])
        theirs = ref(**inputs).loss
    assert n == int((inputs["labels"] != -100).sum())
    torch.testing.assert_close(loss_sum / n, theirs, rtol=1e-5, atol=1e-5)
