# QLoRA of Mistral-7B-Instruct-v0.3 (32 layers, GQA 32:8, no sliding window in v0.3) on Magicoder-OSS-Instruct-75K,
# prompts through the model's own chat template, so the fine-tune answers in the format it is prompted with at
# inference.
#
#   python train.py configs/mistral.py

model = "mistralai/Mistral-7B-Instruct-v0.3"  # a Hub id (fetched into the Hugging Face cache) or a local directory
data = "ise-uiuc/Magicoder-OSS-Instruct-75K"  # a Hub dataset id (its JSONL file) or a local file
data_format = "magicoder"
template = ""  # the chat template: [INST] question [/INST] answer</s>
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
out_dir = "out/mistral"
