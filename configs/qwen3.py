# QLoRA of Qwen3-8B (per-head q/k RMSNorm, head_dim 128, 36 layers, GQA 32:8) on Magicoder-OSS-Instruct-75K,
# prompts through the model's own chat template, so the fine-tune answers in the format it is prompted with at
# inference.
#
#   python train.py configs/qwen3.py

model = "Qwen/Qwen3-8B"  # a Hub id (fetched into the Hugging Face cache) or a local directory
data = "ise-uiuc/Magicoder-OSS-Instruct-75K"  # a Hub dataset id (its JSONL file) or a local file
data_format = "magicoder"
template = ""  # the chat template (ChatML; the final answer gets the empty think block the template renders)
context_length = "auto"
val_fraction = 0.01

quantize = True
lora_r = 16
lora_alpha = 32.0
lora_dropout = 0.05
lora_targets = "all-linear"

precision = "bf16"
batch_tokens = 65536
micro_batch_tokens = "auto"
max_steps = 520
lr = 2e-4
warmup_steps = 20

eval_every = 100
eval_rows = 64
save_every = 100
eval_samples = 2  # held-out answers at every evaluation, in metrics.jsonl
out_dir = "out/qwen3"
