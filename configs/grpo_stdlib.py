# GRPO on the standard library's doctested functions (support/data/problems.py), the 24 with the shortest solutions:
# SmolLM2-135M-Instruct QLoRA (the default model), 2 problems x 8 sampled answers a step, each answer rewarded 1 when
# its function passes the docstring's doctests in the sandbox; HumanEval pass@1 of the greedy answers before and after.
# 28 minutes on 2 CPU cores, 19 of them the two HumanEval evaluations (docs/performance.md, "GRPO on CPU").

max_examples = 24
group_size = 8
problems_per_step = 2
max_steps = 10
sample_tokens = 192
context_length = 448
micro_batch_tokens = 1024  # about a group a forward: its prompt once and its 8 answers (~1,000 tokens)
temperature = 0.8
kl_coef = 0.04
lr = 5e-4
warmup_steps = 0
min_lr_ratio = 1.0
precision = "fp32"
eval_every = 10
save_every = 5
eval_task = "humaneval"
eval_task_at = "ends"
out_dir = "out/grpo"
