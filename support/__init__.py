"""The support folder: everything a training step does not need to be understood (file formats, kernel selection,
memory planning, checkpoints, export, ...). Each file answers one question; the textbook files call them."""
