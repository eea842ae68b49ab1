"""What does a finished run leave behind?

In out_dir: adapter/ (PEFT's format, which transformers + PEFT and vLLM load), loss.png (training and validation loss
over the steps), and on request merged/ (the adapters folded into the base, a plain Hugging Face model) and
model-<type>.gguf with its Ollama Modelfile. The merge is checked before anything of it is written
(support/merge_check.py) and its report joins metrics.jsonl. On the terminal: the validation loss before and after,
and the held-out prompt's answer before and after training beside the reference, each with its similarity to it.
"""

import difflib
import os

from support import gguf_files, hf
from support.atomic import atomic_write
from support.checkpoint import save_metrics
from support.merge_check import merge_and_check_
from support.tokenizer import render


def write_outputs(cfg, model, tok, held_out, history, samples, model_dir):
    """The adapter, the loss plot, the samples (before, after: strings, or None when not asked for) and, on request,
    a merged export and a GGUF."""
    adapter_dir = os.path.join(cfg.out_dir, "adapter")
    hf.save_adapter(model, adapter_dir, base_model_name_or_path=os.path.abspath(model_dir))
    print(f"adapter written to {adapter_dir}")
    plot_losses(history, os.path.join(cfg.out_dir, "loss.png"))
    vals = [h["val_loss"] for h in history if "val_loss" in h]
    if len(vals) > 1:
        print(f"val loss: {vals[0]:.4f} -> {vals[-1]:.4f}")
    prompt, reference, bos = render(held_out, tok, cfg.template or None)
    if samples:
        similarity = [difflib.SequenceMatcher(None, s, reference).ratio() for s in samples]
        print(f"--- held-out prompt ---\n{prompt}\n--- reference ---\n{reference}")
        for when, text, sim in zip(("before", "after"), samples, similarity, strict=True):
            print(f"--- {when} training (similarity {sim:.3f}) ---\n{text}")
    if cfg.export_merged or cfg.export_gguf:
        export(cfg, model, history, model_dir, tok.encode(prompt, bos=bos))


def export(cfg, model, history, model_dir, prompt_ids):
    """The merge, checked on the held-out prompt, into out_dir/merged; its check joins metrics.jsonl; then the GGUF."""
    merged_dir = os.path.join(cfg.out_dir, "merged")
    original = hf.Checkpoint(model_dir) if cfg.quantize and not hf.is_prequantized(model_dir) else None
    _, report = merge_and_check_(model, [prompt_ids], original=original)
    history.append({"step": cfg.max_steps, "merge": report})
    save_metrics(cfg, history)
    hf.export_merged(model, merged_dir, tokenizer_dir=model_dir)
    print(f"merged model written to {merged_dir} (merged into {report['merged_into']} weights)")
    if cfg.export_gguf:
        gguf = os.path.join(cfg.out_dir, f"model-{cfg.export_gguf}.gguf")
        path = gguf_files.export_gguf(merged_dir, gguf, cfg.export_gguf)
        print(f"GGUF written to {path} (Ollama: ollama create NAME -f {gguf_files.modelfile_path(path)})")


def plot_losses(history, path):
    """Training and validation loss over the steps, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for key, style, label in (("loss", "-", "train"), ("val_loss", "o-", "validation")):
        if points := [(h["step"], h[key]) for h in history if key in h]:
            ax.plot(*zip(*points, strict=True), style, label=label)
    ax.set(xlabel="step", ylabel="loss (nats / supervised token)", title="nanoqlora")
    ax.legend()
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png"))
    plt.close(fig)
