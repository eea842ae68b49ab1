# GRPO that visibly learns on 2 CPU cores: support/data/easy.py's small functions (sum of a list, count the vowels,
# x * k + c, ...), each answer rewarded 1 when it passes 20 random inputs no prompt shows. Before training, the base
# model answers each of the 32 drawn problems 8 times and only those it sometimes passes and sometimes fails are kept
# (learnable_only): a group whose answers all get one reward teaches nothing. Held-out pass@1 and pass@8 (8 answers to
# each of 24 problems from 4 templates never trained on) before and after.
#
# The base is not quantized: SmolLM2-135M in NF4 passes 2 of HumanEval's 164 problems where the 16-bit model passes 9,
# and a group learns only from answers that sometimes pass. About 30 minutes on 2 CPU cores; held-out pass@1 rose
# from 26% to 37% and from 25% to 53% over two seeds, against 0% for a shuffled-reward control (docs/performance.md).

data = "easy"
max_examples = 32
learnable_only = True
quantize = False
precision = "fp32"
group_size = 8
problems_per_step = 2
max_steps = 30
sample_tokens = 64
context_length = 256
temperature = 0.8
kl_coef = 0.0
lr = 1e-3
warmup_steps = 0
min_lr_ratio = 1.0
eval_task = "easy"
eval_task_problems = 24
eval_task_samples = 8
eval_task_temperature = 0.8
eval_task_at = "ends"
eval_every = 30
save_every = 10
out_dir = "out/grpo-easy"
