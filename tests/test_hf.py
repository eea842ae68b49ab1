"""hf.py against its references: the Hugging Face files it reads and writes.

- config.json: a family that needs more than a switch is refused with what it would need; each family's config.json
  carries only Hugging Face keys, as its transformers config class spells them, and reads back into the same config
  (logits against transformers for every family are in test_model.py).
- Loading: malformed model directories (missing file or shard, corrupt safetensors, unsupported architecture or RoPE,
  missing config keys, wrong shapes, missing or unexpected tensors) fail with one line naming the file and the tensor.
- bnb-4bit: our pre-quantized checkpoints reload bit-exactly and load in transformers + bitsandbytes with the same
  logits; checkpoints written by transformers + bitsandbytes load in ours with theirs; mismatched files fail in one
  line.
- Writing: every file comes out with the permissions of an ordinary write (0666 minus the umask, never mkstemp's
  0600), config.json carries the dtype under both keys transformers reads, a write that fails half-way leaves the
  old file and no temporary file behind, and what a writer killed mid-write left is removed by a later write
  (never a live writer's, nor a user's file).

(PEFT adapters and merged exports are proven against PEFT and transformers in test_lora.py.)
"""

import fcntl
import json
import os
import stat
import subprocess
import sys
import time

import bitsandbytes as bnb
import pytest
import torch
import transformers
from safetensors.torch import load_file, save_file
from test_model import tiny_config

import lora
import quant
from model import Llama, LlamaConfig
from support.formats.atomic import atomic_write, write_json, write_safetensors
from support.formats.hf import config_json, export_merged, from_hf, read_config, save_adapter, save_quantized, to_hf
from support.kernels import nf4_ops
from train import load_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    tie_word_embeddings=True,
)


def tiny_llama(dtype=torch.float32):
    return Llama(LlamaConfig(**TINY)).to(dtype)


def buffers(layer):
    return [layer.weight, layer.absmax, layer.nested_absmax, layer.offset]


def load_quantized(path):
    return load_model(path, torch.float32, quantize=True)


def hf_model(**kw):
    """A tiny random transformers Llama (transformers' own initialisation)."""
    cfg = transformers.LlamaConfig(
        vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, max_position_embeddings=256, **kw
    )
    return transformers.LlamaForCausalLM(cfg).eval()


# ----------------------------------------------------------------------------- loading


@pytest.fixture
def saved(tmp_path):
    hf_model(num_attention_heads=4, num_key_value_heads=2).save_pretrained(tmp_path)
    return tmp_path


def edit_config(path, **changes):
    """Rewrite keys of the config.json in `path`."""
    d = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**d, **changes}))


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="needs Linux's /proc/self/maps")
def test_loaded_model_keeps_no_view_of_the_file(saved):
    """A model loaded in its checkpoint's own dtype holds copies, not views of the memory-mapped safetensors file: a
    view of one tensor (the fp32 embeddings) kept the whole file mapped, and on CPU resident, for the whole run."""
    model = load_model(saved, torch.float32, quantize=True)
    maps = open("/proc/self/maps").read()
    assert model.model.embed_tokens.weight.dtype == torch.float32
    assert str(saved / "model.safetensors") not in maps


def test_load_model_hands_the_nf4_layers_the_kernel_chosen_for_the_device(saved, monkeypatch):
    """load_model asks support/kernels/nf4_ops.py once for the op that dequantizes on its device and every NF4 linear
    gets it, adapted ones included (on CPU: the reference op; the choice itself is tested in test_nf4_ops.py)."""
    assert {m.dequantize_op for m in load_quantized(saved).modules() if isinstance(m, quant.NF4Linear)} == {
        nf4_ops.REFERENCE_OP
    }
    asked = []
    kernel = lambda *args: nf4_ops.REFERENCE_OP(*args)  # noqa: E731
    monkeypatch.setattr(nf4_ops, "dequantize_op_for", lambda device: asked.append(device) or kernel)
    adapters = dict(targets=["q_proj"], r=2, alpha=4, dropout=0.0)
    model = load_model(saved, torch.float32, quantize=True, add_lora=adapters)
    layers = [m for m in model.modules() if isinstance(m, quant.NF4Linear)]
    assert asked == [torch.device("cpu")] and len(layers) == 14 and all(m.dequantize_op is kernel for m in layers)
    assert sum(isinstance(m, lora.LORA) for m in layers) == 2


def test_error_missing_model_file(saved):
    (saved / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=f"{saved}.*model.safetensors"):
        load_model(saved)


def test_error_missing_shard(tmp_path):
    hf_model(num_attention_heads=4, num_key_value_heads=2).save_pretrained(tmp_path, max_shard_size="20KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=f"{shard}: checkpoint shard not found"):
        load_model(tmp_path)


def test_error_index_without_weight_map(tmp_path):
    hf_model(num_attention_heads=4, num_key_value_heads=2).save_pretrained(tmp_path, max_shard_size="20KB")
    (index := tmp_path / "model.safetensors.index.json").write_text('{"metadata": {}}')
    with pytest.raises(ValueError, match=rf"^{index}: no weight_map"):
        load_model(tmp_path)


def test_error_corrupt_safetensors(saved):
    (saved / "model.safetensors").write_bytes(b"\x13\x37 definitely not a safetensors header" * 3)
    with pytest.raises(ValueError, match="model.safetensors: not a valid safetensors file"):
        load_model(saved)


def test_error_unsupported_architecture(saved):
    edit_config(saved, architectures=["GemmaForCausalLM"], model_type="gemma")
    with pytest.raises(ValueError, match=r"config.json: model_type 'gemma'"):
        load_model(saved)
    edit_config(saved, architectures=["LlamaForSequenceClassification"], model_type="llama")
    with pytest.raises(ValueError, match=r"config.json: architectures.*LlamaForSequenceClassification"):
        load_model(saved)


@pytest.mark.parametrize(
    "key, rope, message",
    [
        ("rope_parameters", {"rope_type": "yarn", "factor": 2.0}, "rope_parameters type 'yarn' is not supported"),
        ("rope_scaling", {"type": "dynamic", "factor": 2.0}, "rope_scaling type 'dynamic' is not supported"),
        ("rope_scaling", {"type": "linear"}, "rope_scaling of type 'linear' lacks factor"),
    ],
)
def test_error_unsupported_rope(saved, key, rope, message):
    edit_config(saved, **{"rope_parameters": None, "rope_theta": 500.0, key: rope})
    with pytest.raises(ValueError, match=f"config.json: {message}"):
        load_model(saved)


def test_error_missing_config_key(saved):
    d = json.loads((saved / "config.json").read_text())
    del d["vocab_size"]
    (saved / "config.json").write_text(json.dumps(d))
    with pytest.raises(ValueError, match="config.json: missing key.s. vocab_size"):
        read_config(saved)


def test_error_shape_mismatch(saved):
    edit_config(saved, intermediate_size=64)
    with pytest.raises(ValueError, match=r"model.safetensors: tensor model.layers.0.mlp.gate_proj.weight has shape"):
        load_model(saved)


def test_error_missing_and_unexpected_tensors(saved):
    tensors = load_file(saved / "model.safetensors")
    save_file({k: v for k, v in tensors.items() if k != "model.norm.weight"}, saved / "model.safetensors")
    with pytest.raises(ValueError, match="tensor model.norm.weight is missing"):
        load_model(saved)
    # old checkpoints carry RoPE frequencies (tolerated); a layer the config does not have is an error
    extra = {
        "model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4),
        "model.layers.5.mlp.up_proj.weight": torch.zeros(48, 32),
    }
    save_file({**tensors, **extra}, saved / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.layers.5.mlp.up_proj.weight$"):
        load_model(saved)


# ----------------------------------------------------------------------------- bnb-4bit


def test_save_and_reload_prequantized_is_bit_exact(tmp_path):
    """save_quantized -> load_model reloads bit-identical buffers and identical logits without
    re-quantizing; transformers + bitsandbytes load the same directory to the same logits (fp32 compute)."""
    from transformers import AutoModelForCausalLM

    model = quant.quantize_(tiny_llama(), compute_dtype=torch.float32)
    save_quantized(model, tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"]["bnb_4bit_quant_type"] == "nf4"
    reloaded = load_quantized(str(tmp_path))
    for (name, a), (_, b) in zip(model.named_modules(), reloaded.named_modules(), strict=True):
        if isinstance(a, quant.NF4Linear):
            assert all(map(torch.equal, buffers(a), buffers(b))), name
    ids = torch.randint(0, 128, (2, 9))
    logits = model(ids)
    assert torch.equal(reloaded(ids), logits)
    ref = AutoModelForCausalLM.from_pretrained(str(tmp_path), device_map="cpu")
    ref.train()  # eval mode on an AVX-512-BF16 CPU would switch Linear4bit to a bf16 kernel
    assert isinstance(ref.model.layers[0].mlp.down_proj, bnb.nn.Linear4bit)
    torch.testing.assert_close(ref(ids).logits, logits, atol=1e-5, rtol=1e-5)


def test_transformers_bnb_4bit_checkpoint_loads(tmp_path):
    """A checkpoint written by transformers + bitsandbytes (BitsAndBytesConfig nf4, double quant, CPU) loads into our
    Llama as is and gives transformers' logits (fp32 compute)."""
    from transformers import BitsAndBytesConfig, LlamaForCausalLM
    from transformers import LlamaConfig as HFConfig

    cfg = dict(TINY, max_position_embeddings=64, rms_norm_eps=1e-6)
    LlamaForCausalLM(HFConfig(**cfg)).save_pretrained(tmp_path / "dense")
    bnb_config = BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.float32,
    )
    ref = LlamaForCausalLM.from_pretrained(tmp_path / "dense", quantization_config=bnb_config, device_map="cpu")
    ref.save_pretrained(tmp_path / "q4")
    assert "model.layers.0.self_attn.q_proj.weight.quant_state.bitsandbytes__nf4" in load_file(
        tmp_path / "q4/model.safetensors"
    )
    ours = load_quantized(str(tmp_path / "q4"))
    ref.train()
    ids = torch.randint(0, 128, (2, 9))
    torch.testing.assert_close(ours(ids), ref(ids).logits, atol=1e-5, rtol=1e-5)


def _corrupt(src, dst, edit):
    os.makedirs(dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    edit(tensors)
    save_file(tensors, os.path.join(dst, "model.safetensors"))
    with open(os.path.join(src, "config.json")) as f, open(os.path.join(dst, "config.json"), "w") as g:
        g.write(f.read())


def _with_state(**changes):
    key = "model.layers.1.mlp.up_proj.weight.quant_state.bitsandbytes__nf4"

    def edit(tensors):
        state = json.loads(bytes(tensors[key].tolist()))
        tensors[key] = torch.tensor(list(json.dumps(state | changes).encode()), dtype=torch.uint8)

    return edit


BAD = {
    "missing absmax": (lambda t: t.pop("model.layers.1.mlp.up_proj.weight.absmax"), "up_proj.weight"),
    "missing nested absmax": (
        lambda t: t.pop("model.layers.1.mlp.up_proj.weight.nested_absmax"),
        "up_proj.weight.nested_absmax",
    ),
    "short absmax": (
        lambda t: t.update({"model.layers.0.self_attn.k_proj.weight.absmax": torch.zeros(3, dtype=torch.uint8)}),
        "k_proj.weight.absmax",
    ),
    "short codes": (
        lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": torch.zeros(10, 1, dtype=torch.uint8)}),
        "k_proj.weight",
    ),
    "wrong shape": (_with_state(shape=[64, 128]), "up_proj.weight.quant_state"),
    "wrong blocksize": (_with_state(blocksize=128), "up_proj.weight.quant_state"),
    "fp4": (_with_state(quant_type="fp4"), "up_proj.weight.quant_state"),
    "other code book": (
        lambda t: t["model.layers.0.mlp.gate_proj.weight.quant_map"].mul_(0.5),
        "gate_proj.weight.quant_map",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_prequantized_file_fails_with_one_line_error(tmp_path, case):
    """A mismatched pre-quantized file (missing or short tensors, wrong shape, blocksize, quant type or code book)
    raises one line naming the file and the tensor instead of loading garbage."""
    good = tmp_path / "good"
    save_quantized(quant.quantize_(tiny_llama()), good)
    edit, tensor = BAD[case]
    _corrupt(good, tmp_path / "bad", edit)
    with pytest.raises((ValueError, KeyError)) as err:
        load_quantized(str(tmp_path / "bad"))
    message = str(err.value)
    assert "\n" not in message and "model.safetensors" in message and tensor in message, message


def test_truncated_prequantized_file_fails_with_one_line_error(tmp_path):
    """A truncated model.safetensors fails with one line naming the file."""
    save_quantized(quant.quantize_(tiny_llama()), tmp_path)
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ValueError) as err:
        load_quantized(str(tmp_path))
    assert "\n" not in str(err.value) and "model.safetensors" in str(err.value)


# ----------------------------------------------------------------------------- writing


@pytest.fixture
def umask_027():
    old = os.umask(0o027)
    yield
    os.umask(old)


def mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def test_written_files_have_ordinary_permissions(tmp_path, umask_027):
    """Adapter, bnb-4bit checkpoint, merged export, JSON files and the files of a directory written whole are created
    0666 & ~umask, as open() would make them: with umask 027, 0640 (mkstemp or safetensors would have left 0600)."""
    with open(tmp_path / "plain.txt", "w") as f:
        f.write("x")
    model = tiny_llama()
    lora.add_lora_(model, "all-linear", r=2, alpha=4, dropout=0.0)
    save_adapter(model, tmp_path / "adapter")
    save_quantized(quant.quantize_(tiny_llama()), tmp_path / "nf4")
    lora.merge_lora_(model)
    export_merged(model, tmp_path / "merged")
    write_json(tmp_path / "metrics.json", {"a": 1})
    weights = {"w": torch.zeros(2)}  # a directory written whole (as a GGUF is converted), safetensors' file inside
    atomic_write(
        tmp_path / "converted", lambda d: save_file(weights, os.path.join(d, "model.safetensors")), directory=True
    )
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert len(files) == 9 and {mode(p) for p in files} == {mode(tmp_path / "plain.txt")} == {0o640}
    assert mode(tmp_path / "converted") == 0o750  # 0777 & ~umask, as os.mkdir makes it


def test_failed_write_keeps_the_old_file(tmp_path):
    """A write that raises half-way (a full disk, say) leaves the old bytes and no temporary file."""
    path = tmp_path / "config.json"
    write_json(path, {"old": True})

    def half(tmp):
        with open(tmp, "w") as f:
            f.write('{"new": ')
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        atomic_write(path, half)
    assert json.loads(path.read_text()) == {"old": True} and os.listdir(tmp_path) == ["config.json"]
    with pytest.raises(OSError, match=rf"^{tmp_path / 'gone' / 'a.json'}: could not write it \(No such file or "):
        write_json(tmp_path / "gone" / "a.json", {})  # a folder that is not there: one line naming the file


def test_a_write_killed_midway_is_swept_by_a_later_one(tmp_path):
    """A process killed while writing (the OOM killer, kill -9) leaves its private temp folder, holding what the
    writer put beside its temp file (safetensors writes its own temp file there: gigabytes for a merged shard, which
    used to stay hidden beside the model forever). A later write of that file removes it once it is a minute old; a
    folder whose lock a live writer holds (here this process) stays, however old."""
    path = tmp_path / "model.safetensors"
    beside = "open(os.path.join(os.path.dirname(tmp), '.tmpXYZ123'), 'w').write('x' * 1000)"
    code = "import os; from support.formats.atomic import atomic_write; "
    code += f"atomic_write({str(path)!r}, lambda tmp: ({beside}, os.kill(os.getpid(), 9)))"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == -9
    (dead,) = os.listdir(tmp_path)
    assert sorted(os.listdir(tmp_path / dead)) == [".lock", ".tmpXYZ123", "model.safetensors"]
    others = [".model.safetensors.20240501-backup", ".model.safetensors.deadbeef.tmp"]  # a user's files: never taken
    for name in others:
        (tmp_path / name).write_text("mine")
    (live := tmp_path / ".model.safetensors.0123abcd.tmp").mkdir()
    lock = os.open(live / ".lock", os.O_CREAT | os.O_WRONLY)
    fcntl.flock(lock, fcntl.LOCK_EX)  # a write under way
    try:
        write_safetensors(path, {"w": torch.zeros(2)})
        assert sorted(os.listdir(tmp_path)) == sorted([dead, live.name, "model.safetensors", *others])  # too young
        for name in (dead, live.name, *others):
            os.utime(tmp_path / name, (time.time() - 120,) * 2)
        write_safetensors(path, {"w": torch.ones(2)})
        assert sorted(os.listdir(tmp_path)) == sorted([live.name, "model.safetensors", *others])
    finally:
        os.close(lock)


def test_config_json_dtype_keys(tmp_path):
    """config.json names the stored dtype as transformers 5 ("dtype") and older releases ("torch_dtype") read it,
    and read_config understands either."""
    d = config_json(LlamaConfig(**TINY), torch.bfloat16)
    assert d["dtype"] == d["torch_dtype"] == "bfloat16"
    assert transformers.LlamaConfig.from_dict(d).dtype == torch.bfloat16
    for key in ("dtype", "torch_dtype"):
        tmp_path.joinpath("config.json").write_text(json.dumps(to_hf(LlamaConfig(**TINY)) | {key: "float16"}))
        assert read_config(tmp_path) == (LlamaConfig(**TINY), torch.float16)


def test_unsupported_family_names_what_is_missing():
    """A model_type that is not a Llama with switches fails in one line saying what it would need."""
    d = to_hf(tiny_config()) | {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"]}
    with pytest.raises(ValueError, match="model_type 'mixtral'.*mixture-of-experts"):
        from_hf(d)
    with pytest.raises(
        ValueError, match="model_type 'gpt2' is not supported \\(expected llama, qwen2, qwen3, mistral\\)"
    ):
        from_hf(d | {"model_type": "gpt2"})
    with pytest.raises(ValueError, match="layer_types.*use_sliding_window"):
        from_hf(d | {"model_type": "qwen2", "architectures": None, "layer_types": ["sliding_attention"] * 2})


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
def test_to_hf_writes_only_config_keys(family):
    """config.json carries keys of the family's Hugging Face config and nothing a fork stores on the config object;
    it reads back to the same config, in ours and in transformers."""
    extra = dict(
        qwen2=dict(qkv_bias=True, sliding_window=5, sliding_layers=[1]),
        qwen3=dict(qk_norm=True, qkv_bias=True, o_bias=True),
    )
    extra["mistral"] = dict(sliding_window=6, sliding_layers=[0, 1])
    cfg = tiny_config(model_type=family, rope_scaling=dict(rope_type="linear", factor=2.0), **extra.get(family, {}))
    cfg.my_experiment = "not a config key"
    d = to_hf(cfg)
    assert "my_experiment" not in d and from_hf(d) == cfg
    theirs = transformers.AutoConfig.for_model(**d)
    legacy = {"architectures", "rope_theta", "rope_scaling"}  # transformers 5 folds the RoPE keys into rope_parameters
    assert set(d) - legacy <= set(theirs.to_dict()), set(d) - set(theirs.to_dict())
    assert (theirs.head_dim, theirs.num_key_value_heads, theirs.rope_parameters["factor"]) == (8, 2, 2.0)
    if family != "llama":
        assert getattr(theirs, "layer_types", ["sliding_attention"] * 2) == [
            "sliding_attention" if i in (cfg.sliding_layers or []) else "full_attention" for i in range(2)
        ]
