"""The benchmarks behind `python bench.py`: speed and memory measured and printed as tables, never asserted in tests;
each file's docstring says what it measures (docs/support.md: how). They use the textbook files and support/; nothing
there uses them."""
