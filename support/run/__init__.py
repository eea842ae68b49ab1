"""What a run needs around its loop: the settings and their checks, out_dir, ranks and FSDP, precision, stops,
checkpoints, progress, trackers and the files a run leaves."""
