# QLoRA of a Llama-3-8B-class checkpoint on Magicoder-OSS-Instruct-75K, with the settings of the fine-tuning recipe
# this project follows: bf16, fused AdamW, sample packing, flash-attn varlen attention (taken automatically on CUDA
# when flash-attn is installed), no activation checkpointing, loss-only evaluation.
#
#   huggingface-cli download meta-llama/Llama-3.1-8B --local-dir checkpoints/Llama-3.1-8B
#   huggingface-cli download ise-uiuc/Magicoder-OSS-Instruct-75K --repo-type dataset --local-dir data
#   python train.py configs/magicoder.py

model = "checkpoints/Llama-3.1-8B"  # any HF-format Llama directory
model_source = "meta-llama/Llama-3.1-8B"  # named in the error message when `model` is missing
data = "data/data-oss_instruct-decontaminated.jsonl"  # problem -> solution pairs
data_source = "ise-uiuc/Magicoder-OSS-Instruct-75K"
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
sample = False
out_dir = "out/magicoder"
