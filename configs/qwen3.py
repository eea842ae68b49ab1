# QLoRA of Qwen3-8B (per-head q/k RMSNorm, head_dim 128, 36 layers, GQA 32:8) on Magicoder-OSS-Instruct-75K,
# prompts through the model's own chat template, so the fine-tune answers in the format it is prompted with at
# inference.
#
#   huggingface-cli download Qwen/Qwen3-8B --local-dir checkpoints/Qwen3-8B
#   huggingface-cli download ise-uiuc/Magicoder-OSS-Instruct-75K --repo-type dataset --local-dir data
#   python train.py configs/qwen3.py

model = "checkpoints/Qwen3-8B"
model_source = "Qwen/Qwen3-8B"
data = "data/data-oss_instruct-decontaminated.jsonl"
data_source = "ise-uiuc/Magicoder-OSS-Instruct-75K"
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
sample = False
out_dir = "out/qwen3"
