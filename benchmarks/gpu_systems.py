"""Which systems does the GPU benchmark train, and how is each built on the one set of random weights?

The model is a random-initialised Llama of a published shape (SHAPES; --shape: 8b = Llama-3.1-8B, 3b = Llama-3.2-3B,
1b = Llama-3.2-1B, tiny = a 2-layer toy for CPU), built straight on the device in bf16 (on the meta device first, so no
fp32 copy ever exists), weights N(0, 0.02). Up to six systems train LoRA r=16, alpha 32, dropout 0.05 on every linear
of the blocks, fp32 adapters under bf16 autocast, fused AdamW, gradient clipping at 1.0, all in one process on the
same weights:

- nanoqlora LoRA: model.Llama with the packed-document attention train.py would pick
  (support.kernels.attention.varlen_attention), 16-bit base, lora.add_lora_, train.forward_loss and
  train.make_optimizer;
- nanoqlora QLoRA: the same, its block linears quant.quantize_'d to NF4 from those weights;
- transformers + PEFT LoRA: LlamaForCausalLM from the same config, attn_implementation="sdpa", holding our very
  weight tensors (load_state_dict(assign=True): the frozen base is shared, not copied, which is what lets three 8B
  models and 8,192-token activations fit on one GPU), peft.get_peft_model(target_modules="all-linear");
- transformers + PEFT + bitsandbytes QLoRA, when bitsandbytes is installed: the same weights written to a temporary
  directory and loaded with BitsAndBytesConfig (NF4, double quantization, bf16 compute);
- transformers + PEFT + Liger, on CUDA when liger-kernel is installed: the LoRA peer with Liger's RMSNorm, SwiGLU and
  fused linear cross-entropy applied to its instance (apply_liger_kernel_to_llama(model=...)). Liger's RoPE is left
  out: it replaces a function of transformers' Llama module that the plain peer, in the same process, calls too;
- transformers + PEFT under torch.compile: the LoRA peer's whole model compiled (what the Trainer's torch_compile
  does); its compilation falls in the warm-up steps;
- nanoqlora LoRA and QLoRA compiled: the same two, their blocks compiled (model.Options.compile; the compiled LoRA
  model a second Llama over the same weight tensors), their compilation in the warm-up steps too.

A system that cannot be built (out of memory, a missing package) keeps its row with the reason; the others carry on.
"""

import gc
import importlib.util
import itertools
import os
import shutil
import tempfile
import time
from dataclasses import dataclass

import torch

import lora
import quant
import train
from benchmarks.common import LORA, OUT_DIR, SEED, hf_batch, nf4_config, peft_lora
from model import Llama, Options
from support.formats import atomic, hf
from support.formats.hf import to_hf
from support.kernels import dropout, dropout_cuda, nf4_ops
from support.kernels.attention import varlen_attention
from support.run import ranks

_LLAMA3 = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    vocab_size=128256,
    num_key_value_heads=8,
    head_dim=128,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    max_position_embeddings=131072,
)
_ROPE = dict(rope_type="llama3", low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=8192)


def llama3(hidden, ffn, layers, heads, rope, **keys):
    """config.json of a Llama 3.x shape: these sizes, its RoPE scaling `rope` (over _ROPE), `keys` over _LLAMA3."""
    sizes = dict(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads)
    return _LLAMA3 | sizes | keys | dict(rope_scaling=_ROPE | rope)


_TOY = dict(vocab_size=512, head_dim=16, num_key_value_heads=2, max_position_embeddings=1024)  # the CPU toy
_TOY_ROPE = dict(factor=8.0, original_max_position_embeddings=128)
# --shape: (name, config.json keys of the published model, default tokens per row). The weights are random.
SHAPES = {
    "8b": ("Llama-3.1-8B", llama3(4096, 14336, 32, 32, dict(factor=8.0)), 8192),
    "3b": ("Llama-3.2-3B", llama3(3072, 8192, 28, 24, dict(factor=32.0), tie_word_embeddings=True), 8192),
    "1b": ("Llama-3.2-1B", llama3(2048, 8192, 16, 32, dict(factor=32.0), head_dim=64, tie_word_embeddings=True), 8192),
    "tiny": ("a 2-layer toy", llama3(64, 176, 2, 4, _TOY_ROPE, **_TOY), 256),
}
LR = 1e-4  # the same for every system; speed does not depend on it
SYSTEMS = {  # key: row label
    "ours-lora": "nanoqlora LoRA",
    "ours-qlora": "nanoqlora QLoRA (NF4)",
    "ours-lora-compiled": "nanoqlora LoRA, compiled",
    "ours-qlora-compiled": "nanoqlora QLoRA (NF4), compiled",
    "peer-lora": "transformers + PEFT LoRA",
    "peer-qlora": "transformers + PEFT + bitsandbytes QLoRA",
    "peer-liger": "transformers + PEFT + Liger LoRA",
    "peer-compile": "transformers + PEFT LoRA, compiled",
}
PAIRS = [
    ("ours-lora", "peer-lora"),
    ("ours-qlora", "peer-qlora"),
    ("ours-qlora", "peer-lora"),
    ("ours-qlora", "ours-lora"),
    ("ours-lora", "peer-liger"),
    ("ours-lora-compiled", "peer-compile"),
    ("ours-qlora-compiled", "peer-compile"),
    ("ours-lora-compiled", "ours-lora"),
]
EAGER = [k for k in SYSTEMS if not k.endswith("compile") and not k.endswith("compiled")]
COMPILED = [k for k in SYSTEMS if k not in EAGER]
# What a system can fail with while being built or stepped: out of memory (a RuntimeError), a missing or mismatched
# package, a bad setting. Each is reported in the system's row; the other systems carry on.
FAILURES = (RuntimeError, ImportError, ValueError, TypeError, OSError)


@dataclass
class System:
    """One trainer under test: forward(batch) gives the mean loss over the supervised tokens, on the device."""

    key: str
    forward: object = None
    model: object = None
    params: list | None = None
    opt: object = None
    within: object = None  # batch -> the context a step's forward and backward run in (None: none)
    status: str = ""  # why it does not run ("failed: ...", "skipped: ..."); "" when it does

    @property
    def label(self):
        return SYSTEMS.get(self.key, self.key)


class Skipped(Exception):
    """A system left out on purpose (its optional package is not installed)."""


def one_line(e):
    return f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:160]}"


def free_cache(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def random_llama(cfg, device, dtype):
    """Our Llama of shape `cfg` on `device` in `dtype`, built on the meta device first (no fp32 copy ever exists), with
    the attention train.py would pick; weights N(0, 0.02) and norms 1 from a seeded generator."""
    with torch.device("meta"):
        model = Llama(cfg, varlen_attention(device, dtype, cfg.head_dim, windowed=bool(cfg.sliding_layers)))
    model = model.to(dtype).to_empty(device=device)
    if cfg.tie_word_embeddings:  # to_empty gives every parameter its own storage
        model.lm_head.weight = model.model.embed_tokens.weight
    gen = torch.Generator(device).manual_seed(SEED)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02, generator=gen) if p.dim() > 1 else p.fill_(1.0)
    return model


def our_llama(cfg, base, device, dtype, options=None, nf4=False):
    """Our Llama over the weights `base` (name -> tensor; a quantized linear's weight may be its NF4Weight), built with
    `options` (model.Options): its block linears quantized from them on `device` when nf4, everything else the very
    storage of base (no copy), so that many systems share one set of weights."""
    with torch.device("meta"):
        model = Llama(cfg, varlen_attention(device, dtype, cfg.head_dim, windowed=bool(cfg.sliding_layers)), options)
    if nf4:
        kernel = nf4_ops.dequantize_op_for(device)
        quant.quantize_(model.to(dtype), compute_dtype=dtype, device=device, weights=base.get, dequantize_op=kernel)
    model.load_state_dict({k: base[k] for k, v in model.state_dict().items() if v.is_meta}, strict=False, assign=True)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def weights_of(model):
    """`model`'s base weights, adapters left out, each NF4 linear's weight as its NF4Weight: what our_llama builds
    another model over, sharing their storage."""
    weights = {k: v for k, v in model.state_dict().items() if ".lora_" not in k}
    return weights | {f"{n}.weight": m.nf4_weight() for n, m in model.named_modules() if isinstance(m, quant.NF4Linear)}


def ours_system(key, model, device, dtype, lr):
    """Adapters on our model, as train.load_model adds them; the loss and optimizer of train.py."""
    torch.manual_seed(SEED)  # the same adapters on LoRA and QLoRA
    dropout_op = dropout_cuda.dropout_op_for(device)  # as train.load_model chooses it
    lora.add_lora_(model, "all-linear", *LORA.values(), lora_dtype=torch.float32, dropout_op=dropout_op)
    place = ranks.Placement(0, 1, device, dtype)
    params = [p for p in model.parameters() if p.requires_grad]

    def forward(batch):
        loss, n = train.forward_loss(model, batch, place)
        return loss / max(n, 1)

    steps = itertools.count()

    def within(batch):  # as train.train_step: the dropout keys of the step's rows, for forward and backward
        keys = dropout.row_keys(SEED, next(steps), range(len(batch["labels"])), device)
        return dropout.dropout_rows(model, keys)

    opt = train.make_optimizer(train.Config(lr=lr), params, device)
    return System(key, forward, model, params, opt, within=within)


def peer_llama(cfg, base, device, dtype):
    """transformers' LlamaForCausalLM of the same config with sdpa attention, holding the tensors of `base`."""
    import transformers

    with torch.device(device):  # a bf16 model, randomly initialised, whose tensors are then replaced by ours
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.LlamaConfig.from_dict(to_hf(cfg)), attn_implementation="sdpa", dtype=dtype
        )
    model.load_state_dict(base, assign=True)  # strict: the names are the same
    return model


def scratch_dir(nbytes):
    """Where a checkpoint of `nbytes` is written to be read straight back: /dev/shm (memory) when it has room for
    twice that, else out/bench on disk."""
    if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 2 * nbytes:
        return "/dev/shm"
    os.makedirs(OUT_DIR, exist_ok=True)
    return OUT_DIR


def peer_qlora_llama(cfg, base, device, dtype):
    """transformers + bitsandbytes NF4 (double quantization, bf16 compute) of the weights `base`, through the one door
    bitsandbytes quantization has in transformers: from_pretrained of a directory, written here to a temporary one."""
    if importlib.util.find_spec("bitsandbytes") is None:
        raise Skipped("bitsandbytes is not installed")
    import transformers

    with tempfile.TemporaryDirectory(dir=scratch_dir(sum(v.nbytes for v in base.values()))) as tmp:
        tied = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
        atomic.write_safetensors(
            os.path.join(tmp, "model.safetensors"), {k: v for k, v in base.items() if k not in tied}
        )
        atomic.write_json(os.path.join(tmp, "config.json"), hf.config_json(cfg, dtype))
        where = device.index if device.type == "cuda" else "cpu"
        return transformers.LlamaForCausalLM.from_pretrained(
            tmp, dtype=dtype, quantization_config=nf4_config(dtype), device_map={"": where}, attn_implementation="sdpa"
        )


def peer_liger_llama(cfg, base, device, dtype):
    """The LoRA peer's model with Liger's kernels applied to the instance (before PEFT wraps its linears)."""
    if device.type != "cuda":
        raise Skipped("Liger's kernels are Triton kernels for a GPU")
    if importlib.util.find_spec("liger_kernel") is None:
        raise Skipped("liger-kernel is not installed")
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    model = peer_llama(cfg, base, device, dtype)
    apply_liger_kernel_to_llama(rope=False, model=model)
    return model


def peer_system(key, model, device, dtype, lr, compile=False):
    """PEFT LoRA on a transformers model (adapters in fp32: PEFT's autocast_adapter_dtype), fused AdamW as the
    Trainer's default; the loss on our batch converted by hf_batch, under the same autocast as ours; with `compile`,
    the PEFT model called through torch.compile."""
    model, params, opt = peft_lora(model, lr)
    amp = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    call = torch.compile(model) if compile else model

    def forward(batch):
        inputs = {k: v.to(device) for k, v in hf_batch(batch).items()}
        with amp:
            return call(**inputs).loss

    return System(key, forward, model, params, opt)


def build_system(key, cfg, base, device, dtype):
    """One system on the weights `base` (the state dict of our random dense Llama)."""
    if key == "peer-lora":
        return peer_system(key, peer_llama(cfg, base, device, dtype), device, dtype, LR)
    if key == "peer-qlora":
        return peer_system(key, peer_qlora_llama(cfg, base, device, dtype), device, dtype, LR)
    if key == "peer-liger":
        return peer_system(key, peer_liger_llama(cfg, base, device, dtype), device, dtype, LR)
    if key == "peer-compile":
        return peer_system(key, peer_llama(cfg, base, device, dtype), device, dtype, LR, compile=True)
    options = Options(compile=key.endswith("-compiled"))
    model = our_llama(cfg, base, device, dtype, options, nf4=key.startswith("ours-qlora"))
    return ours_system(key, model, device, dtype, LR)


def build_systems(cfg, keys, device, dtype):
    """The systems named in `keys`, in SYSTEMS order, all on one set of random weights; a system that cannot be built
    gets its reason as status. The dense base tensors live on only as long as some system holds them."""
    base = dict(random_llama(cfg, device, dtype).state_dict())  # references, no copies
    built = {}
    # Liger's peer after the other peers: applying it also swaps the classes transformers builds Llamas from.
    order = ("peer-lora", "peer-compile", "peer-qlora", "peer-liger")
    for key in (*order, *(k for k in SYSTEMS if k.startswith("ours"))):
        if key not in keys:
            continue
        start = time.perf_counter()
        try:
            built[key] = build_system(key, cfg, base, device, dtype)
        except Skipped as e:
            built[key] = System(key, status=f"skipped: {e}")
        except FAILURES as e:
            built[key] = System(key, status=f"failed: {one_line(e)}")
            free_cache(device)
        print(f"{SYSTEMS[key]}: built in {time.perf_counter() - start:.1f} s {built[key].status}".rstrip(), flush=True)
    return [built[k] for k in SYSTEMS if k in built]
