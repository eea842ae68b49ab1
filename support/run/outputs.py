"""What does a finished run leave behind?

In out_dir: adapter/ (PEFT's format, which transformers + PEFT load), loss.png (training and validation loss over the
steps), and on request merged/ (the adapters folded into the base, a plain Hugging Face model) and model-<type>.gguf
with its Ollama Modelfile. The merge is checked before anything of it is written (support/evaluation/merge_check.py) and
its report joins metrics.jsonl. On the terminal: the validation loss before and after, eval_task's pass@1 at the first
and the last evaluation that scored it, and the first held-out prompt's answer at the first and the last evaluation
beside the reference, each with its similarity to it.
"""

import difflib
import os

from support.data.tokenizer import render
from support.evaluation import humaneval
from support.evaluation.merge_check import merge_and_check_
from support.formats import gguf_write, hf, modelfile
from support.formats.atomic import atomic_write
from support.run.checkpoint import save_metrics


def write_outputs(cfg, model, tok, prompts, history, adapter, model_dir, tracker=None):
    """The adapter (`adapter`: its tensors by parameter name, whole), the loss plot, the first held-out answer at the
    first and at the last evaluation beside its reference and, on request, a merged export and a GGUF."""
    adapter_dir = os.path.join(cfg.out_dir, "adapter")
    hf.save_adapter(model, adapter_dir, base_model_name_or_path=os.path.abspath(model_dir), weights=adapter)
    print(f"adapter written to {adapter_dir}")
    plot_losses(history, os.path.join(cfg.out_dir, "loss.png"))
    vals = [h["val_loss"] for h in history if "val_loss" in h]
    if len(vals) > 1:
        print(f"val loss: {vals[0]:.4f} -> {vals[-1]:.4f}")
    if task := humaneval.summary(cfg.eval_task, history):
        print(task)
    answers = [(h["step"], h["samples"][0]["answer"]) for h in history if h.get("samples")]
    if prompts and len(answers) > 1:
        prompt, reference, _ = render(prompts[0], tok, cfg.template or None)
        print(f"--- held-out prompt ---\n{prompt}\n--- reference ---\n{reference}")
        for (step, text), when in zip((answers[0], answers[-1]), ("before", "after"), strict=True):
            sim = difflib.SequenceMatcher(None, text, reference).ratio()
            print(f"--- {when} training (step {step}, similarity {sim:.3f}) ---\n{text}")
    if cfg.export_merged or cfg.export_gguf:
        export(cfg, model, history, model_dir, held_out_ids(cfg, tok, prompts), tracker)
    if tracker:
        tracker.close()


def held_out_ids(cfg, tok, prompts) -> list[int]:
    """The token ids the merge check runs: the first held-out prompt, or a few fixed tokens without one."""
    if not prompts:
        return tok.encode("def fibonacci(n):")
    prompt, _, bos = render(prompts[0], tok, cfg.template or None)
    return tok.encode(prompt, bos=bos)


def export(cfg, model, history, model_dir, prompt_ids, tracker=None):
    """The merge, checked on the held-out prompt, into out_dir/merged; its check joins metrics.jsonl; then the GGUF."""
    merged_dir = os.path.join(cfg.out_dir, "merged")
    original = hf.Checkpoint(model_dir) if cfg.quantize and not hf.is_prequantized(model_dir) else None
    _, report = merge_and_check_(model, [prompt_ids], original=original)
    history.append({"step": cfg.max_steps, "merge": report})
    save_metrics(cfg, history)
    if tracker:
        tracker.log(history[-1])
    hf.export_merged(model, merged_dir, tokenizer_dir=model_dir)
    print(f"merged model written to {merged_dir} (merged into {report['merged_into']} weights)")
    if cfg.export_gguf:
        gguf = os.path.join(cfg.out_dir, f"model-{cfg.export_gguf}.gguf")
        path = gguf_write.export_gguf(merged_dir, gguf, cfg.export_gguf)
        print(f"GGUF written to {path} (Ollama: ollama create NAME -f {modelfile.modelfile_path(path)})")


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
