"""The benchmarks behind `python bench.py`: speed and memory are measured here and printed as tables, never asserted
in tests. Each file answers one question and its docstring explains its benchmark: common.py what they all share
(timing, tables, the machine, child processes, interleaved ratios), quant.py NF4 throughput and QLoRA load times,
cpu_train.py CPU training against transformers + PEFT and the optimization ladder (with the peer's child run),
gpu_systems.py, gpu_workloads.py and gpu.py the one-process GPU comparison, pack.py tokenizing and packing, and
first_run.py a newcomer's first `python train.py`. They use the textbook files and support/; nothing there uses them."""
