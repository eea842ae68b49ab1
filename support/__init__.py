"""Everything a training step does not need to be understood, in six folders by what they answer; each file in them
answers one question, and the textbook files call each by one line:

    kernels/     which kernel computes a technique's step on this device (attention, dropout, NF4, long rows)
    data/        how rows of a dataset become token ids, a cache, a preview
    formats/     how models, adapters and files are read and written (Hugging Face, GGUF, the Hub, atomic writes)
    run/         what a run needs around its loop (settings, ranks, stops, checkpoints, progress, outputs)
    accounting/  how much memory and compute a run takes, and what fits
    evaluation/  how a model is judged (generation, the sandbox, HumanEval, the merge check)

Imports go one way: textbook files import support; kernels/ and data/ import no textbook file, the other folders may
(docs/internals.md has the tiers)."""
