# A seconds-long run for tests: few steps, short rows, a small slice of the stdlib dataset. Point `model` at any small
# HF-format Llama directory (the tests build a tiny random one).

max_examples = 64
context_length = 128
batch_tokens = 512
micro_batch_tokens = 256
max_steps = 4
warmup_steps = 1
lr = 1e-3
lora_r = 4
lora_alpha = 8.0
lora_dropout = 0.0
precision = "fp32"
eval_every = 2
eval_rows = 4
save_every = 2
eval_samples = 0
out_dir = "out/tiny"
