"""lora.py against PEFT and transformers on a tiny random Llama (built and saved by transformers, loaded by ours);
adapters and merged models go through hf.py's PEFT and Hugging Face writers and readers.

What this file proves:
- with B = 0 the adapted model's logits equal the base's bit for bit (dense and NF4, dropout active), base tensors are
  shared and keep their names, and the parameter counts (NF4 counted as in*out) add up;
- an optimizer step moves only LoRA parameters: dense weights and NF4 buffers are bit-identical afterwards;
- our adapter files have PEFT's tensor names/shapes and config values (every field vLLM's adapter loader reads among
  them; vLLM itself cannot be installed here), and PeftModel.from_pretrained on the transformers base gives our logits
  (1e-5, fp32), with rsLoRA, dropout > 0 in eval mode and a subset of targets;
- adapters saved by PEFT (random non-zero B), also with `.default` key names and a stripped config, load into ours with
  PEFT's logits, either applying add_lora_ themselves or into a model that already has it;
- the merged export is a directory transformers loads (sharded, tokenizer files copied) with our adapter-on-base logits
  (1e-4); an NF4 base merged into the original 16-bit weights equals the same adapter on the 16-bit base (1e-4), stays
  within the base's own quantization error of the adapter-on-NF4 model, and each module reports which weights it
  started from (original, or the exact merge into the dequantized copy);
- fp32 LoRA parameters on a bf16 base (lora_dtype) give bf16 outputs and fp32 gradients on the LoRA parameters only;
- an adapter loaded into a model in eval mode has no live dropout (PEFT's logits without calling eval again);
- mismatched adapters (rank, unknown module, other base shapes, unsupported options, missing file) fail in one line,
  and so do an adapter's tensors loaded into a model without LoRA modules;
- for Qwen2 (biased q/k/v), Qwen3 (q/k norms, biased o_proj) and Mistral bases, adapters load in PEFT on the
  family's own transformers class with our logits and merged exports load in that class, from a QLoRA model whose
  biases stayed 16-bit and frozen.
"""

import copy
import json

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from test_quant import nf4_linear
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from transformers import LlamaConfig as HFLlamaConfig
from transformers import LlamaForCausalLM

import lora
import quant
from model import Llama
from support.evaluation.merge_check import merge_and_check_
from support.formats.hf import Checkpoint, adapter_settings, export_merged, from_hf, load_adapter_, save_adapter
from train import load_model

IDS = torch.tensor([[1, 5, 9, 17, 33, 2, 60, 7, 100, 3], [4, 4, 8, 15, 16, 23, 42, 0, 99, 1]])
HF_CONFIG = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    initializer_range=0.1,  # large enough that the logits (and their differences) are far from zero
)
PROJS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj")
PROJS += ("mlp.up_proj", "mlp.down_proj")


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    """A tiny random fp32 transformers Llama saved in HF format, with a small tokenizer beside it."""
    path = tmp_path_factory.mktemp("base")
    torch.manual_seed(0)
    LlamaForCausalLM(HFLlamaConfig(**HF_CONFIG)).save_pretrained(path)
    Tokenizer(WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0")).save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "PreTrainedTokenizerFast"}))
    return path


def ours(base_dir):
    return load_model(base_dir).eval()


def hf_logits(model):
    with torch.no_grad():
        return model(input_ids=IDS).logits


def attach(model, adapter_dir):
    """A saved adapter on `model` as train.load_model puts it there: the adapters its config describes, then its
    tensors; returns the adapter's config."""
    lora.add_lora_(model, **adapter_settings(adapter_dir, model))
    return load_adapter_(model, adapter_dir)


@torch.no_grad()
def randomize_B(model):
    for name, p in model.named_parameters():
        if ".lora_B." in name:
            p.normal_(0, 0.3)


@pytest.mark.parametrize("nf4", [False, True])
def test_adapters_off_is_the_base_model(base_dir, nf4):
    """Within lora.adapters_off a trained-looking adapter (B away from zero) is skipped: the logits are the base
    model's exactly, with gradients flowing to nothing; after the block, and after an exception inside it, the
    adapters are back."""
    model = ours(base_dir)
    if nf4:
        quant.quantize_(model, compute_dtype=torch.float32)
    with torch.no_grad():
        ref = model(IDS)
    lora.add_lora_(model, "all-linear", r=4, alpha=8, dropout=0.0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
        adapted = model(IDS)
        assert (adapted - ref).abs().max() > 1e-3
        with lora.adapters_off(model):
            assert torch.equal(model(IDS), ref)
        with pytest.raises(RuntimeError, match="inside"), lora.adapters_off(model):
            raise RuntimeError("inside")
        assert torch.equal(model(IDS), adapted)


@pytest.mark.parametrize("nf4", [False, True])
def test_zero_B_is_the_base_model(base_dir, nf4):
    model = ours(base_dir)
    dense_total = sum(p.numel() for p in model.parameters())
    expected_trainable = sum(
        4 * (m.in_features + m.out_features) for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear)
    )
    if nf4:
        quant.quantize_(model, compute_dtype=torch.float32)
    with torch.no_grad():
        ref = model(IDS)
    base_state = model.state_dict(keep_vars=True)
    trainable, total = lora.add_lora_(model, "all-linear", r=4, alpha=8, dropout=0.5)
    model.train()  # dropout is live on the LoRA branch; the base path must not see it
    with torch.no_grad():
        assert torch.equal(model(IDS), ref)
    state = model.state_dict(keep_vars=True)
    assert all(state[k] is v for k, v in base_state.items())  # same names, same tensor objects: nothing copied
    lora_keys = {f"model.layers.{i}.{p}.lora_{ab}.weight" for i in range(2) for p in PROJS for ab in "AB"}
    assert set(state) - set(base_state) == lora_keys
    assert {n for n, p in model.named_parameters() if p.requires_grad} == lora_keys
    assert (trainable, total) == (expected_trainable, dense_total + expected_trainable)


def test_an_adapted_nf4_linear_keeps_its_base_s_kernel_and_error():
    """with_lora over an NF4Linear keeps the base's dequantize_op (the kernel chosen when the model was built) and
    rel_error, and its forward dequantizes with that op."""
    base = nf4_linear(torch.nn.Linear(64, 32), torch.float32)
    calls = []
    base.dequantize_op = lambda *args: calls.append(args[4]) or quant.dequantize_nf4(*args)
    layer = lora.with_lora(base, r=2, alpha=4, dropout=0.0, use_rslora=False, lora_dtype=None)
    assert layer.dequantize_op is base.dequantize_op and layer.rel_error == base.rel_error is not None
    layer(torch.randn(3, 64))
    assert calls == [[32, 64]]


@pytest.mark.parametrize("nf4", [False, True])
def test_optimizer_step_moves_only_lora(base_dir, nf4):
    model = ours(base_dir)
    if nf4:
        quant.quantize_(model, compute_dtype=torch.float32)
    lora.add_lora_(model, ["q_proj", "v_proj", "down_proj"], r=4, alpha=8, dropout=0.1)
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)  # all parameters: frozen ones get no grad
    labels = torch.cat([IDS[:, 1:], torch.full((2, 1), -100)], dim=1)
    for _ in range(2):  # step 1 moves B only (A's gradient is B^T(...) = 0), step 2 moves A too
        loss, n = model(IDS, labels=labels)
        (loss / n).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    after = model.state_dict()
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved == {k for k in before if ".lora_" in k} and len(moved) == 2 * 3 * 2


def test_fp32_lora_params_on_bf16_base(base_dir):
    model = load_model(base_dir, torch.bfloat16)
    lora.add_lora_(model, ["q_proj", "o_proj"], r=4, alpha=8, dropout=0.0, lora_dtype=torch.float32)
    randomize_B(model)
    loss, n = model(IDS, labels=IDS)
    loss.backward()
    grads = {k: p.grad.dtype for k, p in model.named_parameters() if p.grad is not None}
    assert model(IDS).dtype == torch.bfloat16 and model.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16
    assert grads == {
        f"model.layers.{i}.self_attn.{p}.lora_{ab}.weight": torch.float32
        for i in range(2)
        for p in ("q_proj", "o_proj")
        for ab in "AB"
    }


@pytest.mark.parametrize(
    "targets,use_rslora,dropout", [(["q_proj", "v_proj", "down_proj"], True, 0.1), ("all-linear", False, 0.0)]
)
def test_our_adapter_loads_in_peft(base_dir, tmp_path, targets, use_rslora, dropout):
    model = ours(base_dir)
    lora.add_lora_(model, targets, r=4, alpha=8, dropout=dropout, use_rslora=use_rslora)
    randomize_B(model)
    model.eval()
    with torch.no_grad():
        logits = model(IDS)
    save_adapter(model, tmp_path / "ours", base_model_name_or_path=str(base_dir))

    # Same config through PEFT itself: identical tensor names and shapes, identical config values.
    cfg = LoraConfig(
        r=4, lora_alpha=8, lora_dropout=dropout, use_rslora=use_rslora, target_modules=targets, task_type="CAUSAL_LM"
    )
    get_peft_model(LlamaForCausalLM.from_pretrained(base_dir), cfg).save_pretrained(tmp_path / "peft")
    ours_t, peft_t = (load_file(tmp_path / d / "adapter_model.safetensors") for d in ("ours", "peft"))
    assert {k: v.shape for k, v in ours_t.items()} == {k: v.shape for k, v in peft_t.items()}
    ours_c, peft_c = (json.loads((tmp_path / d / "adapter_config.json").read_text()) for d in ("ours", "peft"))
    for key in ("r", "lora_alpha", "lora_dropout", "use_rslora", "bias", "task_type", "peft_type", "use_dora"):
        assert ours_c[key] == peft_c[key], key
    # vLLM's adapter loader (its PEFTHelper) reads r, lora_alpha, bias, use_rslora, use_dora (above), target_modules
    # (below: PEFT reads ours as the very modules adapted) and modules_to_save, which it refuses unless None.
    assert ours_c["modules_to_save"] is None and peft_c["modules_to_save"] is None

    hf = LlamaForCausalLM.from_pretrained(base_dir)
    base = hf_logits(hf)
    peft = PeftModel.from_pretrained(hf, tmp_path / "ours").eval()
    ref = hf_logits(peft)
    # PEFT reads our target_modules as naming exactly the adapted modules (no extra, no missing).
    peft_adapted = {n.removeprefix("base_model.model.") for n, _ in peft.named_modules() if n.endswith(".lora_A")}
    ours_adapted = {f"{n}.lora_A" for n, m in model.named_modules() if isinstance(m, lora.LoRALinear)}
    assert peft_adapted == ours_adapted
    assert (logits - ref).abs().max() < 1e-5
    assert (ref - base).abs().max() > 0.1  # the adapter really changes the model


def save_peft_adapter(base_dir, path):
    """A PEFT adapter with random non-zero A and B; returns (base logits, adapter logits) from transformers + PEFT."""
    hf = LlamaForCausalLM.from_pretrained(base_dir)
    base = hf_logits(hf)
    cfg = LoraConfig(
        r=4,
        lora_alpha=16,
        lora_dropout=0.2,
        use_rslora=True,
        target_modules=["k_proj", "o_proj", "up_proj"],
        init_lora_weights=False,
        task_type="CAUSAL_LM",
    )
    peft = get_peft_model(hf, cfg).eval()
    peft.save_pretrained(path)
    return base, hf_logits(peft)


@pytest.mark.parametrize("style", ["as_saved", "default_names_stripped_config", "lora_already_added", "into_eval"])
def test_peft_adapter_loads_in_ours(base_dir, tmp_path, style):
    base, ref = save_peft_adapter(base_dir, tmp_path)
    model = ours(base_dir)
    if style == "into_eval":  # new adapter modules follow the model's mode: no live dropout in an eval model
        attach(model.eval(), tmp_path)
        with torch.no_grad():
            assert (model(IDS) - ref).abs().max() < 1e-5
        return
    if style == "default_names_stripped_config":  # PEFT's in-memory names and only the fields that matter
        tensors = load_file(tmp_path / "adapter_model.safetensors")
        tensors = {k.replace(".weight", ".default.weight"): v for k, v in tensors.items()}
        save_file(tensors, tmp_path / "adapter_model.safetensors")
        cfg = json.loads((tmp_path / "adapter_config.json").read_text())
        keep = ("peft_type", "r", "lora_alpha", "use_rslora", "target_modules")
        (tmp_path / "adapter_config.json").write_text(json.dumps({k: cfg[k] for k in keep}))
    if style == "lora_already_added":
        lora.add_lora_(model, ["k_proj", "o_proj", "up_proj"], r=4, alpha=16, dropout=0.2, use_rslora=True)
        load_adapter_(model, tmp_path)
    else:
        attach(model, tmp_path)
    model.eval()
    with torch.no_grad():
        logits = model(IDS)
    assert (logits - ref).abs().max() < 1e-5
    assert (ref - base).abs().max() > 0.1


def test_merged_export_loads_in_transformers(base_dir, tmp_path):
    model = ours(base_dir)
    lora.add_lora_(model, "all-linear", r=4, alpha=8, dropout=0.1)
    randomize_B(model)
    model.eval()
    with torch.no_grad():
        adapter = model(IDS)
    sources, report = merge_and_check_(model, [[1, 2, 3, 4], [9, 8, 7]])
    assert set(sources.values()) == {"dense"} and len(sources) == 14 and report["merge_error"] < 1e-4
    assert not any(isinstance(m, (lora.LoRALinear, quant.NF4Linear)) for m in model.modules())
    out = tmp_path / "merged"
    export_merged(model, out, tokenizer_dir=base_dir, shard_size=100_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1  # really sharded
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        assert (out / f).read_bytes() == (base_dir / f).read_bytes()
    assert not (out / "tokenizer.model").exists()

    merged = hf_logits(LlamaForCausalLM.from_pretrained(out).eval())
    base = hf_logits(LlamaForCausalLM.from_pretrained(base_dir).eval())
    assert (merged - adapter).abs().max() < 1e-4
    assert (merged - base).abs().max() > 0.1


@pytest.mark.parametrize("targets", [["q_proj", "lm_head"], ["q_proj"]])
def test_a_merged_lm_head_adapter_unties_the_export(tmp_path, targets):
    """A tied model (lm_head is the embedding): with an adapter on lm_head the merged export writes lm_head and says
    tie_word_embeddings false, and transformers gives the adapter-on-base logits (it used to leave lm_head out, so
    transformers re-tied it to the embedding and the adapter's update was lost); without one it stays tied."""
    torch.manual_seed(0)
    LlamaForCausalLM(HFLlamaConfig(**HF_CONFIG | {"tie_word_embeddings": True})).save_pretrained(tmp_path / "base")
    model = ours(tmp_path / "base")
    lora.add_lora_(model, targets, r=4, alpha=8, dropout=0.0)
    randomize_B(model)
    with torch.no_grad():
        adapter = model(IDS)
    lora.merge_lora_(model)
    export_merged(model, tmp_path / "merged")
    untied = "lm_head" in targets
    assert json.loads((tmp_path / "merged" / "config.json").read_text())["tie_word_embeddings"] is not untied
    assert ("lm_head.weight" in load_file(tmp_path / "merged" / "model.safetensors")) is untied
    merged = hf_logits(LlamaForCausalLM.from_pretrained(tmp_path / "merged").eval())
    assert (merged - adapter).abs().max() < 1e-4


def test_nf4_merge_into_original_weights(base_dir, tmp_path):
    model = ours(base_dir)
    with torch.no_grad():
        base16 = model(IDS)
    quant.quantize_(model, compute_dtype=torch.float32)
    with torch.no_grad():
        base4 = model(IDS)
    lora.add_lora_(model, ["q_proj", "up_proj"], r=4, alpha=8, dropout=0.0)
    randomize_B(model)
    with torch.no_grad():
        adapter4 = model(IDS)
    save_adapter(model, tmp_path)
    adapter16 = ours(base_dir)  # the same adapter on the unquantized base: what a merge into the original must equal
    attach(adapter16, tmp_path)
    with torch.no_grad():
        adapter16 = adapter16(IDS)

    into_deq = copy.deepcopy(model)  # without original weights: exact merge into the dequantized 4-bit copy
    assert set(lora.merge_lora_(into_deq).values()) == {"dequantized"}
    with torch.no_grad():
        assert (into_deq(IDS) - adapter4).abs().max() < 1e-4

    ckpt = Checkpoint(base_dir)
    mixed = copy.deepcopy(model)  # only layer 0 available: each module says which weights it used
    sources = lora.merge_lora_(mixed, {k: ckpt.get(k) for k in ckpt.keys() if k.startswith("model.layers.0.")})
    assert {n for n, s in sources.items() if s == "original"} == {f"model.layers.0.{p}" for p in PROJS}
    assert {n for n, s in sources.items() if s == "dequantized"} == {f"model.layers.1.{p}" for p in PROJS}

    sources = lora.merge_lora_(model, ckpt)
    assert set(sources.values()) == {"original"} and len(sources) == 14
    with torch.no_grad():
        merged = model(IDS)
    assert (merged - adapter16).abs().max() < 1e-4
    # Against the adapter-on-NF4 model it was trained as, the merge differs only by the base's quantization error.
    quant_err = (base16 - base4).abs().max()
    assert quant_err > 0 and (merged - adapter4).abs().max() < 2 * quant_err


def saved_adapter(base_dir, path, targets=("q_proj", "v_proj")):
    model = ours(base_dir)
    lora.add_lora_(model, list(targets), r=4, alpha=8, dropout=0.0)
    save_adapter(model, path, base_model_name_or_path=str(base_dir))
    return path


def edit_config(path, **changes):
    cfg = json.loads((path / "adapter_config.json").read_text())
    (path / "adapter_config.json").write_text(json.dumps(cfg | changes))


@pytest.mark.parametrize(
    "case,error,match",
    [
        ("rank", ValueError, r"has shape \(4, 64\), expected \(8, 64\) from r=8"),
        ("unknown_module", ValueError, r"adapter_config.json: .*'c_attn' matches no linear"),
        ("other_base", ValueError, r"down_proj\.lora_A\.weight has shape \(4, 128\)"),
        ("dora", ValueError, "use_dora"),
        # options newer PEFT writes that change what the adapter computes: LoRA only from given tokens on, a filter
        # on the targets (aLoRA used to load as plain LoRA, logits 1.08 off PEFT's; exclude_modules failed as a missing
        # tensor)
        ("alora", ValueError, r"unsupported LoRA options \['alora_invocation_tokens'\]"),
        ("exclude", ValueError, r"unsupported LoRA options \['exclude_modules'\]"),
        ("missing_file", FileNotFoundError, "adapter_model.safetensors"),
        ("no_adapters", ValueError, "adapter_config.json: the model has no LoRA modules to load it into"),
    ],
)
def test_mismatched_adapter_errors(base_dir, tmp_path, case, error, match):
    path = saved_adapter(base_dir, tmp_path / "a", ("q_proj", "v_proj", "down_proj"))
    model = ours(base_dir)
    if case == "rank":
        edit_config(path, r=8)
    if case == "unknown_module":
        edit_config(path, target_modules=["q_proj", "c_attn"])
    if case == "other_base":
        model = Llama(from_hf({**HF_CONFIG, "intermediate_size": 96, "model_type": "llama"}))
    if case == "dora":
        edit_config(path, use_dora=True)
    if case == "alora":
        edit_config(path, alora_invocation_tokens=[2, 40])
    if case == "exclude":
        edit_config(path, exclude_modules=["model.layers.0.self_attn.q_proj"])
    if case == "missing_file":
        (path / "adapter_model.safetensors").unlink()
    with pytest.raises(error, match=match) as e:
        (load_adapter_ if case == "no_adapters" else attach)(model, path)
    assert "\n" not in str(e.value)


FAMILY = {
    "qwen2": dict(),
    "qwen3": dict(head_dim=24, attention_bias=True),
    "mistral": dict(sliding_window=6, tie_word_embeddings=True),
}


@pytest.mark.parametrize("family", FAMILY)
def test_family_adapter_and_merged_export(tmp_path, family):
    import transformers

    name = {"qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral"}[family]
    cfg = getattr(transformers, f"{name}Config")(**{**HF_CONFIG, "tie_word_embeddings": False, **FAMILY[family]})
    ref_cls = getattr(transformers, f"{name}ForCausalLM")
    torch.manual_seed(0)
    base = ref_cls(cfg)
    with torch.no_grad():
        for n, p in base.named_parameters():
            if n.endswith("bias"):
                p.normal_(0, 0.5)
    base.save_pretrained(tmp_path / "base")
    model = load_model(tmp_path / "base", quantize=True)
    lora.add_lora_(model, "all-linear", r=4, alpha=8, dropout=0.0)
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    assert bool(biases) == (family != "mistral")
    assert all(not p.requires_grad and p.dtype == torch.float32 for p in biases)  # frozen, in the compute dtype
    randomize_B(model)
    model.eval()
    save_adapter(model, tmp_path / "adapter")
    dense = load_model(tmp_path / "base").eval()  # the adapter on the 16-bit base, as PEFT will run it
    attach(dense, tmp_path / "adapter")
    with torch.no_grad():
        ours16 = dense(IDS)
    peft = PeftModel.from_pretrained(ref_cls.from_pretrained(tmp_path / "base"), tmp_path / "adapter").eval()
    assert (hf_logits(peft) - ours16).abs().max() < 1e-5
    sources, _ = merge_and_check_(model, [[1, 2, 3]], original=Checkpoint(tmp_path / "base"))
    assert set(sources.values()) == {"original"}
    export_merged(model, tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert type(merged) is ref_cls
    assert (hf_logits(merged) - ours16).abs().max() < 1e-4
