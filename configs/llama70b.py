# QLoRA of a Llama-3.1-70B-class model, sharded over two 24 GB GPUs with FSDP2 (a 70B base is about 37 GB in NF4: it
# fits no single 24 or 48 GB card). The settings are what `--plan=2x24GB` chooses for it: the NF4 base and the
# adapters sharded and offloaded to CPU memory between uses (each rank keeps about 19 GB of it in RAM), activation
# checkpointing, 4 rows of 2,048 tokens per micro-batch (20.6 GiB estimated per GPU).
#
#   torchrun --nproc_per_node=2 train.py configs/llama70b.py
#   python train.py configs/llama70b.py --plan=2x24GB     # the plan itself; --plan=4xH100 etc. for other machines

model = "meta-llama/Llama-3.1-70B"  # a Hub id (fetched into the Hugging Face cache) or a local directory
data = "ise-uiuc/Magicoder-OSS-Instruct-75K"
data_format = "magicoder"
template = "### Instruction:\n{instruction}\n\n### Response:\n{response}"  # a base model has no chat template
context_length = 2048
val_fraction = 0.01

parallel = "fsdp"  # under torchrun: every weight sharded over the ranks (support/run/ranks.py)
cpu_offload = True  # the shards live in CPU memory between uses
quantize = True
lora_r = 16
lora_alpha = 32.0
lora_dropout = 0.05
lora_targets = "all-linear"

precision = "bf16"
optimizer = "adamw"
activation_checkpointing = True
batch_tokens = 32768  # 16 rows of 2,048 tokens per optimizer step over both GPUs: 2 micro-batches of 4 rows each
micro_batch_tokens = 8192
max_steps = 1000
lr = 1e-4
warmup_steps = 20

eval_every = 100
eval_rows = 32
eval_samples = 2
save_every = 100
out_dir = "out/llama70b"
