"""What a run needs around its loop: the settings and their checks, the processes that share it (ranks, FSDP), what it
shows as it goes (progress, trackers), and its out_dir (the claim, checkpoints, early stops, the files it leaves).
docs/support.md explains each file at length."""
