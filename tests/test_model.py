"""model.py against references: transformers' LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM and
MistralForCausalLM for logits (sliding windows included) and greedy generation (loaded through train.load_model);
single-document runs for packed rows, and a mask in their place (refused under a shorter sliding window); full-logit
cross-entropy for the chunked loss (which holds one chunk of logits at a time, as memory.py counts); a full recompute
for the KV cache; config.json round trips with only Hugging Face keys; the one target-matching rule that quant.quantize_
and lora.add_lora_ share; an adapted lm_head, which the chunked loss refuses in one line.

Attention backends: every backend that runs on CPU equals an fp64 per-document reference (forward and gradients, GQA,
windows); flash-attn and torch's varlen kernel are checked by contract against stand-ins that enforce their own input
checks and signatures; the backend choice is right for simulated GPUs (pre-Ampere, fp32, big heads) and broken
flash-attn installs; per-document attention and the loss chunks reach their kernels only at a few bucket lengths; a
compiled packed QLoRA step has no graph break, does not recompile for other document counts, and equals eager (in bf16
autocast: no farther from the fp32 step than eager is). On a GPU, every kernel it runs equals the reference in bf16,
and the compiled step holds there too.

On CPU the comparisons run on tiny random models in fp32 (the compiled step also in bf16), so they are fast and exact up
to float rounding.
"""

import json
import weakref

import pytest
import torch
import torch.nn.functional as F
import transformers
from torch._dynamo.utils import compilation_time_metrics, counters
from torch.utils._python_dispatch import TorchDispatchMode

import lora
import model as M
import quant
import support.kernels.attention as A
from model import Llama, LlamaConfig
from support.evaluation.sampling import generate_batch
from support.formats.hf import to_hf
from support.kernels import dropout_cuda, nf4_ops
from support.kernels.dropout import dropout_rows, row_keys
from train import load_model

LLAMA3 = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16
)
CONFIGS = {
    "mha_untied_default_rope": dict(num_attention_heads=4, num_key_value_heads=4),
    "gqa_tied_llama3": dict(
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, rope_parameters=LLAMA3
    ),
    "gqa_head_dim_linear_sharded": dict(
        num_attention_heads=4, num_key_value_heads=1, head_dim=16, rope_parameters=dict(rope_type="linear", factor=4.0)
    ),
}


def hf_model(**kw):
    """A tiny random transformers Llama whose weights are large enough to give varied logits."""
    kw.setdefault("rope_parameters", {"rope_type": "default"})
    kw["rope_parameters"] = {"rope_theta": 500.0, **kw["rope_parameters"]}
    cfg = transformers.LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        max_position_embeddings=256,
        initializer_range=0.3,
        attn_implementation="eager",
        **kw,
    )
    hf = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # norm weights start at 1; randomise them so a missed multiplication shows
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return hf


def to_classic_form(path):
    """Rewrite a transformers-5 config.json (rope_parameters) the way published checkpoints spell RoPE."""
    d = json.loads((path / "config.json").read_text())
    rope = d.pop("rope_parameters")
    d["rope_theta"] = rope.pop("rope_theta")
    kind = rope.pop("rope_type")
    if kind != "default":  # Llama 2 era files say "type", Llama 3.1 files "rope_type"
        d["rope_scaling"] = {"type" if kind == "linear" else "rope_type": kind, **rope}
    (path / "config.json").write_text(json.dumps(d))


@pytest.mark.parametrize("form", ["rope_parameters", "classic"])
@pytest.mark.parametrize("name", CONFIGS)
def test_logits_match_transformers(tmp_path, name, form):
    hf = hf_model(**CONFIGS[name])
    sharded = name.endswith("sharded")
    hf.save_pretrained(tmp_path, max_shard_size="20KB" if sharded else "50GB")
    assert (tmp_path / "model.safetensors.index.json").exists() == sharded
    if form == "classic":
        to_classic_form(tmp_path)
    ours = load_model(tmp_path)
    assert ours.lm_head.weight.dtype == torch.float32
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == hf.config.tie_word_embeddings
    ids = torch.randint(0, 97, (2, 40))
    far = torch.arange(100, 140).expand(2, 40)  # past original_max_position_embeddings: all llama3 bands in play
    with torch.no_grad():
        for pos in (None, far):
            ref = hf(ids, position_ids=pos).logits
            assert (ours(ids, pos) - ref).abs().max() < 1e-4
        # to_hf(): transformers reads our config.json back into the same model
        hf2 = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_dict(to_hf(ours.config))).eval()
        hf2.load_state_dict(ours.state_dict())
        assert (hf2(ids, position_ids=far).logits - ref).abs().max() < 1e-4


FAMILIES = {
    "qwen2_gqa_untied": ("Qwen2", dict(num_key_value_heads=2)),
    "qwen2_tied_sliding": (
        "Qwen2",
        dict(
            num_key_value_heads=1,
            tie_word_embeddings=True,
            use_sliding_window=True,
            sliding_window=6,
            max_window_layers=1,
        ),
    ),
    "qwen3_head_dim_bias": ("Qwen3", dict(num_key_value_heads=2, head_dim=12, attention_bias=True)),
    "qwen3_tied": ("Qwen3", dict(num_key_value_heads=4, head_dim=8, tie_word_embeddings=True)),
    "mistral_sliding": ("Mistral", dict(num_key_value_heads=2, head_dim=12, sliding_window=6)),
    "mistral_full_tied": ("Mistral", dict(num_key_value_heads=1, sliding_window=None, tie_word_embeddings=True)),
}


def family_model(name):
    """A tiny random transformers model of a family, with norms and biases far from their initial values."""
    family, kw = FAMILIES[name]
    cfg = getattr(transformers, f"{family}Config")(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        max_position_embeddings=256,
        initializer_range=0.3,
        attn_implementation="eager",
        rope_parameters={"rope_type": "default", "rope_theta": 500.0},
        **kw,
    )
    ref = getattr(transformers, f"{family}ForCausalLM")(cfg).eval()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            if name.endswith("bias"):
                p.normal_(0, 0.5)
    return ref


@pytest.mark.parametrize("name", FAMILIES)
def test_family_logits_match_transformers(tmp_path, name):
    """Qwen2/2.5 (q/k/v biases), Qwen3 (per-head q/k RMSNorm, explicit head_dim, attention_bias) and Mistral
    (sliding window) from their own config.json: logits within 1e-4 of transformers, including 40-token sequences
    far longer than a window of 6; packed documents equal each document alone and transformers on it; greedy
    generation through the KV cache (window applied to the cached keys) equals transformers' generate; and to_hf
    gives back a config transformers builds the same model from."""
    ref = family_model(name)
    ref.save_pretrained(tmp_path)
    ours = load_model(tmp_path)
    assert ours.config.model_type == ref.config.model_type
    ids = torch.randint(0, 97, (2, 40))
    with torch.no_grad():
        for pos in (None, torch.arange(100, 140).expand(2, 40)):
            assert (ours(ids, pos) - ref(ids, position_ids=pos).logits).abs().max() < 1e-4
        packed_ids, pos, spans = packed_batch()
        packed = ours(packed_ids, pos)
        for row, s, e in spans:
            alone = packed_ids[row : row + 1, s:e]
            assert (packed[row, s:e] - ours(alone, pos[row : row + 1, s:e])[0]).abs().max() < 1e-5
            assert (packed[row, s:e] - ref(alone, position_ids=pos[row : row + 1, s:e]).logits[0]).abs().max() < 1e-4
        again = type(ref)(type(ref.config).from_dict(to_hf(ours.config))).eval()
        again.load_state_dict(ours.state_dict())
        assert (again(ids).logits - ours(ids)).abs().max() < 1e-4
    prompt = [1, 40, 41, 9, 13, 77]
    want = ref.generate(torch.tensor([prompt]), max_new_tokens=20, do_sample=False, pad_token_id=0)[0, len(prompt) :]
    assert generate_batch(ours, [prompt], 20, eos_id=ref.generation_config.eos_token_id)[0] == want.tolist()


def tiny_config(**kw):
    base = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4)
    return LlamaConfig(**{**base, "num_key_value_heads": 2, "head_dim": 8, "eos_token_id": 2, **kw})


def packed_batch():
    """Two rows of 15 tokens: row 0 holds documents of 5, 3 and 7 tokens; row 1 continues a document (positions
    3..6) and then holds one of 11 tokens."""
    pos = torch.tensor([list(range(5)) + list(range(3)) + list(range(7)), list(range(3, 7)) + list(range(11))])
    spans = [(0, 0, 5), (0, 5, 8), (0, 8, 15), (1, 0, 4), (1, 4, 15)]  # (row, start, end)
    return torch.randint(0, 97, (2, 15)), pos, spans


def test_packed_rows_match_documents_alone():
    """Each document of a packed row has the logits it has alone; without position_ids a row is one sequence; `only`
    gives the rows of the full logits at those positions (rl.py's answer tokens)."""
    model = Llama(tiny_config()).eval()
    ids, pos, spans = packed_batch()
    with torch.no_grad():
        packed = model(ids, pos)
        for row, s, e in spans:
            alone = model(ids[row : row + 1, s:e], pos[row : row + 1, s:e])[0]
            assert (packed[row, s:e] - alone).abs().max() < 1e-5
        # without position_ids each row is one causal sequence
        assert (model(ids[:1]) - model(ids[:1], torch.arange(15)[None])).abs().max() < 1e-5
        at = torch.tensor([0, 7, 16, 29])  # of the 2 x 15 positions
        assert (model(ids, pos, only=at) - packed.flatten(0, 1)[at]).abs().max() < 1e-6


def test_a_mask_replaces_the_documents_and_a_shorter_window_refuses_it():
    """A (B, T, T) mask that lets each token see its own document's earlier tokens gives the packed forward's logits;
    in a model whose sliding window is shorter than the row it is refused in one line, and within the window it holds
    there too."""
    ids, pos, spans = packed_batch()
    doc = torch.zeros(2, 15, dtype=torch.long)
    for n, (row, s, e) in enumerate(spans):
        doc[row, s:e] = n
    at = torch.arange(15)
    mask = (at[None, None] <= at[None, :, None]) & (doc[:, None, :] == doc[:, :, None])  # (2, 15, 15)
    for window, T in ((None, 15), (8, 8)):
        model = Llama(tiny_config(sliding_window=window, sliding_layers=[0, 1] if window else None)).eval()
        with torch.no_grad():
            assert (
                model(ids[:, :T], pos[:, :T], mask=mask[:, :T, :T]) - model(ids[:, :T], pos[:, :T])
            ).abs().max() < 1e-5
    with pytest.raises(ValueError, match="shorter sliding window"):
        model(ids, pos, mask=mask)


def rebuilt(model, **options):
    """A Llama of `model`'s config with these options (model.Options), holding a copy of its weights."""
    twin = Llama(model.config, options=M.Options(**options))
    twin.load_state_dict(model.state_dict())
    return twin


def test_chunked_loss_and_grads():
    model = Llama(tiny_config(num_hidden_layers=3), options=M.Options(loss_chunk=4))  # 21 supervised tokens: 6 chunks
    ids, pos, _ = packed_batch()
    labels = torch.randint(0, 97, (2, 15))
    labels[torch.rand(2, 15) < 0.3] = -100

    def run(fn):
        model.zero_grad()
        loss = fn()
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    ref_loss, ref_grads = run(
        lambda: F.cross_entropy(model(ids, pos).flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    )
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.shape) or t, lambda t: t):
        loss, n = model(ids, pos, labels=labels)
    assert n == int((labels != -100).sum()) and loss.dtype == torch.float32
    assert not [s for s in saved if s[-1] == 97], "vocabulary-wide logits were kept for the backward pass"
    # checkpointed, and the naive full-logits path (loss_chunk 0): the same loss and gradients
    for twin in (model, rebuilt(model, loss_chunk=4, checkpointing=True), rebuilt(model, loss_chunk=0)):
        twin.zero_grad()
        got_loss = twin(ids, pos, labels=labels)[0]
        got_loss.backward()
        assert torch.allclose(got_loss, ref_loss, rtol=1e-5)
        for g, r in zip([p.grad for p in twin.parameters()], ref_grads, strict=True):
            assert torch.allclose(g, r, atol=1e-5, rtol=1e-4)
    # nothing supervised: zero loss that still backpropagates
    loss, n = model(ids, pos, labels=torch.full_like(labels, -100))
    loss.backward()
    assert n == 0 and loss.item() == 0.0


class LiveBytes(TorchDispatchMode):
    """The most bytes held at once by the storages of at least `numel` elements behind the tensors that ops return
    (views and in-place results share their tensor's storage, counted once), each until its last tensor is freed.
    Memory an op uses only inside itself (logsumexp's scratch) is not seen."""

    def __init__(self, numel):
        super().__init__()
        self.numel, self.live, self.peak, self.refs = numel, 0, 0, {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.numel() >= self.numel:
                key, n = t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()
                if key not in self.refs:
                    self.refs[key], self.live = 0, self.live + n
                    self.peak = max(self.peak, self.live)
                self.refs[key] += 1
                weakref.finalize(t, self._free, key, n)
        return out

    def _free(self, key, n):
        self.refs[key] -= 1
        if not self.refs[key]:
            del self.refs[key]
            self.live -= n


def test_the_chunked_loss_holds_one_chunk_of_logits_at_a_time():
    """Over three chunks of bf16 rows: 6 bytes a logit of one chunk are alive at once (the fp32 logits beside the
    matmul's bf16 output or the bf16 gradient; with logsumexp's scratch, memory.py's 8); the previous chunk's logits
    and gradient used to stay alive while the next chunk's were made, 12 bytes a logit."""
    chunk, vocab, n = 64, 512, 3 * 64
    h, w = torch.randn(n, 32, dtype=torch.bfloat16), torch.randn(vocab, 32, dtype=torch.bfloat16)
    with torch.no_grad(), LiveBytes(chunk * vocab) as live:
        M.linear_cross_entropy(h, w, torch.randint(0, vocab, (n,)), chunk, grad=True)
    assert live.peak == 6 * chunk * vocab, live.peak / (chunk * vocab)


def test_the_fused_loss_lets_go_of_its_gradient_once_backward_has_passed_it_on():
    """LinearCrossEntropy makes the gradient for h (tokens x hidden) in forward; backward hands it on and drops it, so
    it is not alive through the blocks' backward that follows (memory.py counts it only until then)."""
    made = []

    def cross_entropy(*args, **kwargs):  # linear_cross_entropy, keeping a weak reference to the gradient it makes
        loss, grad_h, grad_w = M.linear_cross_entropy(*args, **kwargs)
        made.append(weakref.ref(grad_h))
        return loss, grad_h, grad_w

    x, w, labels = torch.randn(8, 16, requires_grad=True), torch.randn(32, 16), torch.randint(0, 32, (8,))
    h = x * 2  # h's producer, whose backward comes after the loss's
    alive_then = []
    h.register_hook(lambda grad: alive_then.append(made[0]() is not None))
    M.LinearCrossEntropy.apply(h, w, labels, 4, cross_entropy).backward()
    grad_h = M.linear_cross_entropy(h.detach(), w, labels, 4, grad=True)[1]
    assert alive_then == [False] and torch.allclose(x.grad, 2 * grad_h)


cuda = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (the CUDA attention and compile paths)"
)


def rel(a, b):
    """||a - b|| / ||b||, in fp64."""
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm())


def qlora_tiny(seed=0, dtype=torch.float32, dropout=0.0, device="cpu", compile=False):
    """A tiny QLoRA model as load_model builds it for `device`: the base in `dtype`, the attention and NF4 kernels
    the device's, fp32 adapters whose dropout the device's op applies, B random; its blocks compiled or not."""
    torch.manual_seed(seed)
    kernel = nf4_ops.dequantize_op_for(device)
    attention = A.varlen_attention(device, dtype, tiny_config().head_dim)
    model = Llama(tiny_config(), attention, M.Options(compile=compile)).to(dtype)
    model = quant.quantize_(model, compute_dtype=dtype, dequantize_op=kernel)
    drop = dropout_cuda.dropout_op_for(device, compiled=compile)
    lora.add_lora_(model, "all-linear", r=2, alpha=4, dropout=dropout, lora_dtype=torch.float32, dropout_op=drop)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    return model


COMPILED = [("cpu", torch.float32), ("cpu", torch.bfloat16)]
COMPILED += [pytest.param("cuda", dtype, marks=cuda) for dtype in (torch.float32, torch.bfloat16)]


def loss_and_grads(model, ids, pos, labels, step, dtype) -> list:
    """[loss, each LoRA gradient] of one training step of `model` on the batch, step `step`'s dropout masks, under
    `dtype` autocast where the model's weights are in it (fp32 models compute in fp32)."""
    model.zero_grad()
    device = ids.device.type
    autocast = torch.autocast(device, dtype=dtype, enabled=next(model.parameters()).dtype != torch.float32)
    with autocast, dropout_rows(model, row_keys(0, step, [0], ids.device)):
        loss, _ = model(ids, pos, labels=labels)
        loss.backward()
    return [loss.detach()] + [p.grad for p in model.parameters() if p.requires_grad]


@pytest.mark.parametrize("device, dtype", COMPILED)
def test_compiled_training_step_has_no_breaks_and_no_recompiles(device, dtype):
    """Compiled blocks (model.Options.compile) on packed QLoRA training steps, LoRA dropout live (inductor; bf16
    autocast too; on CUDA with the attention varlen_attention picks there): the compiled blocks run inside each block's
    call, so hooks on a block (FSDP's gathering) run around them; no graph break in a block (NF4 dequantization and the
    per-document attention are opaque ops) and no second trace of one (a block's floats are constants: as symbols
    they failed every first trace); the first step's graphs serve every later batch, whatever its document count and
    lengths; loss and LoRA gradients equal eager's, dropout masks included: within 1e-4 in fp32; in bf16, where
    compiled kernels round differently, each no farther from the fp32 step than twice eager's distance plus a margin:
    2^-10 for the loss (a quarter of bf16's relative step, 2^-8: the loss sums the cross-entropy of hidden states
    rounded to bf16, and eager's loss may land closer to fp32's than the rounding promises), 2^-8 for a gradient
    (both sit about 2^-7 from fp32, and eager's lands closer by luck on some tensors; a wrong mask or graph is off by
    order 1); evaluation and generation never reach the compiler."""
    torch._dynamo.reset()
    counters.clear()  # torch._dynamo.reset() clears compilation_time_metrics
    torch.backends.cuda.matmul.fp32_precision = "ieee"  # the fp32 reference; conftest's autouse fixture restores it
    built = (qlora_tiny(dtype=dtype, dropout=0.25, device=device, compile=c).to(device) for c in (False, True))
    eager, compiled = built
    models = [eager, compiled]
    if dtype != torch.float32:  # the same weights and NF4 codes, every matmul in fp32
        models.append(qlora_tiny(dtype=torch.float32, dropout=0.25, device=device).to(device))
        models[2].load_state_dict(eager.state_dict())  # eager's bf16 weights, in fp32, and its NF4 codes
    calls = []
    for block in compiled.model.layers:
        block.register_forward_pre_hook(lambda *_: calls.append(1))
    graphs, distances = None, []  # bf16: per step, (compiled's, eager's) distance from fp32 of the loss and gradients
    for step, lens in enumerate(([5, 3, 8], [4, 4, 4, 4], [16], [2, 2, 2, 2, 2, 6], [7, 9, 11, 3])):
        pos = torch.cat([torch.arange(n) for n in lens])[None].to(device)
        ids, labels = torch.randint(0, 97, pos.shape, device=device), torch.randint(0, 97, pos.shape, device=device)
        results = [loss_and_grads(model, ids, pos, labels, step, dtype) for model in models]
        if dtype == torch.float32:
            assert all(torch.allclose(c, e, rtol=1e-4, atol=1e-6) for c, e in zip(results[1], results[0], strict=True))
        else:
            distances.append([(rel(c, r), rel(e, r)) for e, c, r in zip(*results, strict=True)])
            (loss_c, loss_e), *grads = distances[-1]
            most = max(c / e for c, e in grads)
            print(f"step {step}: loss {loss_c:.1e} (eager {loss_e:.1e}) from fp32; gradients {most:.2f}x eager's")
        graphs = graphs or counters["stats"]["unique_graphs"]
        assert counters["stats"]["unique_graphs"] == graphs  # no recompilation after the first step
    for (loss_c, loss_e), *grads in distances:
        assert loss_c <= 2 * loss_e + 2**-10 and all(c <= 2 * e + 2**-8 for c, e in grads), distances
    assert 1 <= graphs <= 2 and not counters["graph_break"], dict(counters["graph_break"])  # x needs grad after layer 0
    attempts = [k for k in compilation_time_metrics if k.startswith("compile_attempt_")]
    assert attempts == ["compile_attempt_0"], attempts  # each graph traced once, its floats fixed
    assert len(calls) == 5 * len(compiled.model.layers)  # every compiled block ran inside its module's call
    frames = counters["frames"]["total"]
    with torch.no_grad():
        compiled(ids, pos)
    generate_batch(compiled, [[1, 2, 3]], 3)
    assert counters["frames"]["total"] == frames


@pytest.mark.parametrize("targets", ["all-linear", ["q_proj", "layers.1.mlp.up_proj"], ["o_proj", "lm_head"]])
def test_quantize_and_lora_pick_the_same_linears(targets):
    """quant.quantize_ and lora.add_lora_ follow the one rule of model.find_linears."""
    quantized = quant.quantize_(Llama(tiny_config()), targets, compute_dtype=torch.float32)
    adapted = Llama(tiny_config())
    lora.add_lora_(adapted, targets, r=2, alpha=4, dropout=0.0)
    nf4 = {n for n, m in quantized.named_modules() if isinstance(m, quant.NF4Linear)}
    assert nf4 == set(lora.lora_modules(adapted)) == set(M.find_linears(Llama(tiny_config()), targets))
    assert ("lm_head" in nf4) == ("lm_head" in targets)
    for typo in (["q_prj"], ["layers.7.mlp.up_proj"]):  # a name that matches nothing is an error in both
        with pytest.raises(ValueError, match=f"target module '{typo[0]}' matches no linear layer"):
            quant.quantize_(Llama(tiny_config()), typo)
        with pytest.raises(ValueError, match=f"add_lora_: .*'{typo[0]}'"):
            lora.add_lora_(Llama(tiny_config()), typo, r=2, alpha=4, dropout=0.0)


def test_adapted_lm_head_needs_the_full_logits_loss():
    """LoRA on lm_head: the chunked loss refuses it in one line; with loss_chunk=0 it trains (lm_head's A and B get
    gradients) and gives the full-logits loss."""
    chunked, model = Llama(tiny_config()), Llama(tiny_config(), options=M.Options(loss_chunk=0))
    for m in (chunked, model):
        lora.add_lora_(m, ["lm_head", "q_proj"], r=2, alpha=4, dropout=0.0)
    ids, pos, _ = packed_batch()
    labels = torch.randint(0, 97, (2, 15))
    with pytest.raises(ValueError, match="lm_head is a LoRALinear.*chunked loss") as e:
        chunked(ids, pos, labels=labels)
    assert "\n" not in str(e.value)
    loss, n = model(ids, pos, labels=labels)
    loss.backward()
    ref = F.cross_entropy(model(ids, pos).flatten(0, 1), labels.flatten(), reduction="sum")
    assert n == 30 and torch.allclose(loss, ref)
    assert model.lm_head.lora_A.weight.grad is not None and model.lm_head.lora_B.weight.grad.abs().max() > 0
