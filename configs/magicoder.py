# QLoRA of a Llama-3-8B-class checkpoint on Magicoder-OSS-Instruct-75K, with the settings of the fine-tuning recipe
# this project follows: bf16, fused AdamW, sample packing, flash-attn varlen attention (taken automatically on CUDA
# when flash-attn is installed), no activation checkpointing, evaluation with two held-out answers.
#
#   python train.py configs/magicoder.py

model = "meta-llama/Llama-3.1-8B"  # a Hub id (fetched into the Hugging Face cache) or a local directory
data = "ise-uiuc/Magicoder-OSS-Instruct-75K"  # a Hub dataset id (its JSONL file) or a local file
data_format = "magicoder"
template = "### Instruction:\n{instruction}\n\n### Response:\n{response}"  # a base model has no chat template
context_length = "auto"  # 95th percentile of example lengths, rounded up to a multiple of 64
val_fraction = 0.01

quantize = True  # NF4 base weights: an 8B model in about 5.5 GB
lora_r = 16
lora_alpha = 32.0
lora_dropout = 0.05
lora_targets = "all-linear"

precision = "bf16"
optimizer = "adamw"  # fused on CUDA
activation_checkpointing = False
batch_tokens = 65536  # tokens per optimizer step; micro-batches are sized automatically and accumulated
micro_batch_tokens = "auto"
max_steps = 520  # about one epoch of the 75K examples
lr = 2e-4
warmup_steps = 20
weight_decay = 0.0

eval_every = 100
eval_rows = 64
save_every = 100
eval_samples = 2  # held-out answers at every evaluation, in metrics.jsonl
out_dir = "out/magicoder"
