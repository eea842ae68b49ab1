"""What does the GPU benchmark train, on what data, and how is a step timed, summarized and compared?

A random Llama of a published shape (SHAPES) is built once on the device; every system (SYSTEMS: ours LoRA and QLoRA,
transformers + PEFT with or without bitsandbytes, Liger or torch.compile, TRL's packed padding-free batching, ours
compiled) trains LoRA on those very weight tensors, in one process; one that cannot be built or stepped keeps its row
with the reason. Two workloads, each run interleaved (step s of every system, then s + 1; the first --warmup steps left
out): equal work (identical full rows, every token supervised: tokens/s compares compute) and natural batching (the
same log-normal documents packed for ours and the packed peer, padded one per row for the other peers: supervised
tokens/s compares useful work). Peak memory is each system's own, as
if it ran alone: what it holds between steps plus the most a step allocated above that (CUDA only).
"""

import contextlib
import gc
import importlib.util
import itertools
import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass

import numpy as np
import torch

import lora
import quant
import train
from benchmarks.common import LORA, OUT_DIR, SEED, hf_batch, hf_packed_batch, median_ratio, nf4_config, peft_lora
from model import Llama, Options
from pack import PackedDataset
from support.accounting import memory
from support.accounting.flops import batch_flops
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
    """config.json of a Llama 3.x shape: these sizes, its RoPE scaling `rope` (over _ROPE; None: none), `keys` over
    _LLAMA3."""
    sizes = dict(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers, num_attention_heads=heads)
    return _LLAMA3 | sizes | keys | dict(rope_scaling=None if rope is None else _ROPE | rope)


_TOY = dict(vocab_size=512, head_dim=16, num_key_value_heads=2, max_position_embeddings=1024)  # the CPU toy
_TOY_ROPE = dict(factor=8.0, original_max_position_embeddings=128)
_SMOLLM2 = dict(vocab_size=49152, num_key_value_heads=3, head_dim=64, rope_theta=1e5, max_position_embeddings=8192)
# --shape: (name, config.json keys of the published model, default tokens per row). The weights are random.
SHAPES = {
    "8b": ("Llama-3.1-8B", llama3(4096, 14336, 32, 32, dict(factor=8.0)), 8192),
    "3b": ("Llama-3.2-3B", llama3(3072, 8192, 28, 24, dict(factor=32.0), tie_word_embeddings=True), 8192),
    "1b": ("Llama-3.2-1B", llama3(2048, 8192, 16, 32, dict(factor=32.0), head_dim=64, tie_word_embeddings=True), 8192),
    "tiny": ("a 2-layer toy", llama3(64, 176, 2, 4, _TOY_ROPE, **_TOY), 256),
    "smollm2": ("SmolLM2-135M", llama3(576, 1536, 30, 9, None, **_SMOLLM2, tie_word_embeddings=True), 2048),
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
    "peer-packed": "transformers + PEFT, packed and padding-free (TRL)",
    "peer-compile": "transformers + PEFT LoRA, compiled",
}
PAIRS = [
    ("ours-lora", "peer-lora"),
    ("ours-qlora", "peer-qlora"),
    ("ours-qlora", "peer-lora"),
    ("ours-qlora", "ours-lora"),
    ("ours-lora", "peer-liger"),
    ("ours-lora", "peer-packed"),
    ("ours-lora-compiled", "peer-compile"),
    ("ours-qlora-compiled", "peer-compile"),
    ("ours-lora-compiled", "ours-lora"),
]
EAGER = [k for k in SYSTEMS if not k.endswith("compile") and not k.endswith("compiled")]
COMPILED = [k for k in SYSTEMS if k not in EAGER]
# What a system can fail with while built or stepped (out of memory is a RuntimeError); reported in its row.
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
    note: str = ""  # how it runs, where that depends on what is installed ("attention sdpa, Liger off")

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


def meta_llama(cfg, device, dtype, options=None):
    """Our Llama on the meta device, with the attention train.py would pick on `device`."""
    with torch.device("meta"):
        return Llama(cfg, varlen_attention(device, dtype, cfg.head_dim, windowed=bool(cfg.sliding_layers)), options)


def tie(model, cfg):
    if cfg.tie_word_embeddings:  # to_empty and assign give every parameter its own storage
        model.lm_head.weight = model.model.embed_tokens.weight
    return model


def random_weights(cfg, device, dtype):
    """The state dict (references, no copies) of our Llama of shape `cfg` on `device` in `dtype` (no fp32 copy ever
    exists): weights N(0, 0.02) and norms 1 from a seeded generator."""
    model = tie(meta_llama(cfg, device, dtype).to(dtype).to_empty(device=device), cfg)
    gen = torch.Generator(device).manual_seed(SEED)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02, generator=gen) if p.dim() > 1 else p.fill_(1.0)
    return dict(model.state_dict())


def our_llama(cfg, base, device, dtype, options=None, nf4=False):
    """Our Llama with `options` over the weights `base` (name -> tensor, or a linear's NF4Weight): its block linears
    quantized from them when nf4, everything else the very storage of base, so that many systems share one set."""
    model = meta_llama(cfg, device, dtype, options)
    if nf4:
        kernel = nf4_ops.dequantize_op_for(device)
        quant.quantize_(model.to(dtype), compute_dtype=dtype, device=device, weights=base.get, dequantize_op=kernel)
    model.load_state_dict({k: base[k] for k, v in model.state_dict().items() if v.is_meta}, strict=False, assign=True)
    return tie(model, cfg)


def weights_of(model):
    """`model`'s base weights (each NF4 linear's as its NF4Weight), adapters left out: what our_llama shares."""
    weights = {k: v for k, v in model.state_dict().items() if ".lora_" not in k}
    return weights | {f"{n}.weight": m.nf4_weight() for n, m in model.named_modules() if isinstance(m, quant.NF4Linear)}


def ours_system(key, model, device, dtype):
    """Adapters on our model as train.load_model adds them; train.py's loss and optimizer."""
    torch.manual_seed(SEED)  # the same adapters on LoRA and QLoRA
    dropout_op = dropout_cuda.dropout_op_for(device, model.options.compile)  # as train.load_model chooses it
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

    opt = train.make_optimizer(train.Config(lr=LR), params, device)
    return System(key, forward, model, params, opt, within=within)


def peer_llama(cfg, base, device, dtype, attention="sdpa"):
    """transformers' LlamaForCausalLM of the same config with `attention`, holding the tensors of `base`."""
    import transformers

    with torch.device(device):  # a bf16 model, randomly initialised, whose tensors are then replaced by ours
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.LlamaConfig.from_dict(to_hf(cfg)), attn_implementation=attention, dtype=dtype
        )
    model.load_state_dict(base, assign=True)  # strict: the names are the same
    return model


def scratch_dir(nbytes):
    """Where a checkpoint of `nbytes` is written to be read straight back: /dev/shm if it has room for twice that."""
    if os.path.isdir("/dev/shm") and shutil.disk_usage("/dev/shm").free > 2 * nbytes:
        return "/dev/shm"
    os.makedirs(OUT_DIR, exist_ok=True)
    return OUT_DIR


def peer_qlora_llama(cfg, base, device, dtype):
    """transformers + bitsandbytes NF4 of the weights `base`, through from_pretrained (bitsandbytes' only door in
    transformers) of a temporary directory."""
    if importlib.util.find_spec("bitsandbytes") is None:
        raise Skipped("bitsandbytes is not installed")
    import transformers

    with tempfile.TemporaryDirectory(dir=scratch_dir(sum(v.nbytes for v in base.values()))) as tmp:
        stored = {k: v for k, v in base.items() if not (k == "lm_head.weight" and cfg.tie_word_embeddings)}
        atomic.write_safetensors(os.path.join(tmp, "model.safetensors"), stored)
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


def peer_packed_llama(cfg, base, device, dtype):
    """(model, note): TRL's packed, padding-free batching (SFTConfig(packing=True, padding_free=True)) as transformers
    runs it: our packed rows, position ids restarting at each document, no attention mask, on the LoRA peer's model
    with flash-attn's varlen kernel where flash-attn is installed, else sdpa under the document mask transformers
    builds from the position ids; Liger's kernels on a GPU where liger-kernel is installed."""
    attention = "flash_attention_2" if importlib.util.find_spec("flash_attn") else "sdpa"
    model = peer_llama(cfg, base, device, dtype, attention)
    liger = device.type == "cuda" and importlib.util.find_spec("liger_kernel") is not None
    if liger:
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(rope=False, model=model)
    return model, f"attention {attention}, Liger {'on' if liger else 'off'}"


def peer_system(key, model, device, dtype, compile=False, note=""):
    """common.peft_lora on a transformers model; the loss on our batch converted by hf_batch (peer-packed: by
    hf_packed_batch), under the same autocast as ours; with `compile`, the PEFT model called through torch.compile."""
    model, params, opt = peft_lora(model, LR)
    amp = torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)
    call = torch.compile(model) if compile else model
    convert = hf_packed_batch if key == "peer-packed" else hf_batch

    def forward(batch):
        inputs = {k: v.to(device) for k, v in convert(batch).items()}
        with amp:
            return call(**inputs).loss

    return System(key, forward, model, params, opt, note=note)


def build_system(key, cfg, base, device, dtype):
    """One system on the weights `base` (the state dict of our random dense Llama)."""
    peers = {"peer-lora": peer_llama, "peer-qlora": peer_qlora_llama, "peer-liger": peer_liger_llama}
    if key == "peer-packed":
        model, note = peer_packed_llama(cfg, base, device, dtype)
        return peer_system(key, model, device, dtype, note=note)
    if key.startswith("peer"):  # peer-compile: the LoRA peer's model, compiled
        model = peers.get(key, peer_llama)(cfg, base, device, dtype)
        return peer_system(key, model, device, dtype, compile=key == "peer-compile")
    options = Options(compile=key.endswith("-compiled"))
    model = our_llama(cfg, base, device, dtype, options, nf4=key.startswith("ours-qlora"))
    return ours_system(key, model, device, dtype)


def build_systems(cfg, keys, device, dtype):
    """The systems named in `keys`, in SYSTEMS order, on one set of random weights; one that cannot be built gets its
    reason as status."""
    base = random_weights(cfg, device, dtype)
    built = {}
    # Liger's peers after the other peers: applying it also swaps the classes transformers builds Llamas from.
    peers = ("peer-lora", "peer-compile", "peer-qlora", "peer-liger", "peer-packed")
    order = (*peers, *(k for k in SYSTEMS if k.startswith("ours")))
    for key in (k for k in order if k in keys):
        start = time.perf_counter()
        try:
            built[key] = build_system(key, cfg, base, device, dtype)
        except Skipped as e:
            built[key] = System(key, status=f"skipped: {e}")
        except FAILURES as e:
            built[key] = System(key, status=f"failed: {one_line(e)}")
            free_cache(device)
        how = built[key].status or built[key].note
        print(f"{SYSTEMS[key]}: built in {time.perf_counter() - start:.1f} s {how}".rstrip(), flush=True)
    return [built[k] for k in SYSTEMS if k in built]


# Natural batching: log-normal lengths like instruction data, each opening with an unsupervised prompt of 10-60%.
DOC_COUNT, DOC_MEDIAN, DOC_SIGMA, PROMPT_SHARE = 2048, 400, 0.8, (0.1, 0.6)


def doc_lengths(n, row):
    """n document lengths from a seeded log-normal, clipped to 8..row; the median shrinks to row / 16 for short rows
    (tiny, smollm2) so that a row still holds many documents."""
    lengths = np.random.default_rng([SEED, 1]).lognormal(np.log(min(DOC_MEDIAN, row / 16)), DOC_SIGMA, n)
    return np.clip(np.rint(lengths), 8, row).astype(np.int64)


def documents(lengths, vocab, prompt_share=PROMPT_SHARE):
    """{tokens uint32, mask uint8, offsets int64} for pack.PackedDataset: random ids in 1..vocab-1 (0 is the pad id),
    the first prompt_share of each document (drawn uniformly per document) unsupervised."""
    rng = np.random.default_rng([SEED, 2])
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = rng.integers(1, vocab, int(offsets[-1]), dtype=np.uint32)
    prompts = np.rint(np.asarray(lengths) * rng.uniform(*prompt_share, len(lengths))).astype(np.int64)
    mask = (np.arange(offsets[-1]) >= np.repeat(offsets[:-1] + prompts, lengths)).astype(np.uint8)  # past the prompt
    return dict(tokens=tokens, mask=mask, offsets=offsets)


def equal_work(vocab, row, rows, steps):
    """The batches of steps 0..steps-1 for every system: `rows` documents of exactly `row` tokens, one per row, every
    token supervised, none seen twice."""
    data = documents(np.full(rows * steps, row), vocab, prompt_share=(0.0, 0.0))
    ds = PackedDataset(data, row, pack=False, seed=SEED)
    return [ds.step_batch(s, rows) for s in range(steps)]


def budget_batches(lens, order, budget):
    """Documents in `order` cut into consecutive batches, each as long as its count x its longest length stays within
    `budget` tokens (a document longer than the budget alone in its batch)."""
    batches, current, longest = [], [], 0
    for d in order:
        n = int(lens[d])
        if current and (len(current) + 1) * max(longest, n) > budget:
            batches.append(current)
            current, longest = [], 0
        current.append(int(d))
        longest = max(longest, n)
    return batches + [current] * bool(current)


def natural_work(vocab, row, rows, n_docs=DOC_COUNT):
    """The same documents two ways: packed into rows of `row` tokens for us, and one per row for the peer with its
    batches (consecutive documents of a seeded shuffle, as many as fit in rows x row padded tokens)."""
    data = documents(doc_lengths(n_docs, row), vocab)
    ours = PackedDataset(data, row, pack=True, seed=SEED)
    peer = PackedDataset(data, row, pack=False, seed=SEED)  # row d holds document d
    order = np.random.default_rng([SEED, 3]).permutation(len(peer.lens))
    return ours, peer, budget_batches(peer.lens, order, rows * row)


def natural_batch(work, rows, packed, step):
    """Step `step`'s batch of natural_work's `work`: our packed rows (the packed peer's too), or the peers' padded
    batch."""
    ours, peer, batches = work
    return ours.step_batch(step, rows) if packed else peer.collate(batches[step % len(batches)])


def resident_bytes(system):
    """What a system holds between steps: its weights and buffers (each storage once, whole where shared),
    bitsandbytes' quantization state, and the optimizer state."""
    tensors = [*system.model.parameters(), *system.model.buffers()]
    for p in list(tensors):
        state = getattr(p, "quant_state", None)
        for s in (state, getattr(state, "state2", None)):
            tensors += [v for v in vars(s).values() if isinstance(v, torch.Tensor)] if s is not None else []
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    opt = [v for st in system.opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]
    return sum(storages.values()) + sum(v.numel() * v.element_size() for v in opt)


def timed_step(system, batch, device, cfg):
    """One optimizer step between device syncs: its seconds, loss, batch counts and model FLOPs, and on CUDA the most
    it allocated above what was allocated before it."""
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    start = time.perf_counter()
    with system.within(batch) if system.within else contextlib.nullcontext():
        loss = system.forward(batch)
        loss.backward()
    torch.nn.utils.clip_grad_norm_(system.params, 1.0)
    system.opt.step()
    system.opt.zero_grad(set_to_none=True)
    value = loss.item()  # waits for the step
    if cuda:
        torch.cuda.synchronize(device)
    ids, supervised = batch["input_ids"], int((batch["labels"] != -100).sum())
    rec = dict(time=time.perf_counter() - start, loss=value, rows=ids.shape[0], width=ids.shape[1], tokens=ids.numel())
    rec |= dict(real=int((ids != 0).sum()), supervised=supervised, flops=batch_flops(cfg, batch["position_ids"]))
    if cuda:
        rec["extra_bytes"] = torch.cuda.max_memory_allocated(device) - before
    return rec


def measured_step(system, batch, device, cfg):
    """One step of `system` for a memory table: status ("fits", "out of memory", "failed: ..."), seconds, tokens/s and,
    on CUDA, the peak = resident + the step's own allocation."""
    try:
        step = timed_step(system, batch, device, cfg)
    except torch.OutOfMemoryError:
        rec = dict(status="out of memory")
    except FAILURES as e:
        rec = dict(status=f"failed: {one_line(e)}")
    else:
        rec = dict(status="fits", step_s=step["time"], tokens_per_s=step["tokens"] / step["time"])
        if "extra_bytes" in step:
            rec["peak_bytes"] = resident_bytes(system) + step["extra_bytes"]
        return rec
    system.opt.zero_grad(set_to_none=True)
    free_cache(device)
    return rec


def qlora_estimate(cfg, tokens, place, checkpointing, offloaded=False, tile=0):
    """The total of support.accounting.memory.run_estimate (what train.py prints) for our QLoRA on a micro-batch of
    `tokens` with these settings."""
    adapters = dict(lora_r=LORA["r"], lora_alpha=LORA["alpha"], lora_dropout=LORA["dropout"], lora_targets="all-linear")
    run = train.Config(quantize=True, activation_checkpointing=checkpointing, offload_checkpoints=offloaded, **adapters)
    return sum(memory.run_estimate(run, cfg, tokens, place, tile_tokens=tile).values())


def run_workload(systems, batch_of, steps, device, cfg, title, deadline=None, save=None):
    """Steps 0..steps-1 of every system that runs, interleaved: ({key: records}, {key: "failed: ..."}); a system whose
    step failed sits out the rest. No round starts after `deadline` (time.time()); save(records, errors) after each."""
    records, errors = {s.key: [] for s in systems}, {}
    for step in range(steps):
        if deadline is not None and time.time() > deadline:
            print(f"{title}: stopped at the deadline after {step} of {steps} rounds", flush=True)
            break
        done = []
        for s in systems:
            if s.status or s.key in errors:
                continue
            try:
                rec = timed_step(s, batch_of(s.key, step), device, cfg)
            except FAILURES as e:
                errors[s.key] = f"failed: {one_line(e)}"
                print(f"{title} step {step + 1}: {s.label} {errors[s.key]}", flush=True)
            else:
                records[s.key].append(rec)
                done.append(f"{s.key} {rec['time']:.3f} s")
                continue
            s.opt.zero_grad(set_to_none=True)  # the failed step's activations went with the exception
            free_cache(device)
        print(f"{title} step {step + 1}/{steps}: {', '.join(done)}", flush=True)
        if save:
            save(records, errors)
    return records, errors


def summarize_system(system, records, warmup, peak_flops):
    """Rates over the measured steps, the batch shape, and peak memory = resident + the largest step's allocation."""
    m = records[warmup:]
    total = lambda k: sum(r[k] for r in m)  # noqa: E731
    t = total("time")
    s = dict(
        step_s=statistics.median(r["time"] for r in m),
        tokens_per_s=total("tokens") / t,
        supervised_per_s=total("supervised") / t,
        fill=total("real") / total("tokens"),
        mfu=total("flops") / t / peak_flops,
        rows=total("rows") / len(m),
        width=total("width") / len(m),
        loss_step1=records[0]["loss"],
        resident_bytes=resident_bytes(system),
    )
    if "extra_bytes" in m[0]:
        s["peak_bytes"] = s["resident_bytes"] + max(r["extra_bytes"] for r in m)
    return s


def workload_result(systems, records, errors, warmup, peak_flops, metric, pairs=PAIRS):
    """{"systems": {key: summary and steps, or status}, "ratios": {"a/b": median_ratio of the per-round metric}}."""
    out = {"systems": {}, "ratios": {}}
    for s in systems:
        status = s.status or errors.get(s.key, "")
        if not status and len(records[s.key]) <= warmup:
            status = "stopped: no measured step (a deadline or a time limit)"
        out["systems"][s.key] = {"status": status} if status else {"steps": records[s.key]}
        out["systems"][s.key] |= {"note": s.note} if s.note else {}
        if not status:
            out["systems"][s.key]["summary"] = summarize_system(s, records[s.key], warmup, peak_flops)
    for a, b in pairs:
        if ratio := pair_ratio(out["systems"], a, b, metric, warmup):
            out["ratios"][f"{a}/{b}"] = ratio | dict(metric=metric)
    return out


def pair_ratio(runs, a, b, metric, warmup):
    """median_ratio of a's `metric` per second over b's over the measured rounds both completed (None without a
    summary); runs: workload_result's systems."""
    if "summary" not in runs.get(a, {}) or "summary" not in runs.get(b, {}):
        return None
    rate = lambda r: r[metric] / r["time"]  # noqa: E731
    rounds = zip(runs[a]["steps"][warmup:], runs[b]["steps"][warmup:], strict=False)
    return median_ratio([(rate(x), rate(y)) for x, y in rounds])
