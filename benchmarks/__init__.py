"""The benchmarks behind `python bench.py`: speed and memory measured and printed as tables, never asserted in tests;
each file's docstring explains its benchmark. They use the textbook files and support/; nothing there uses them."""
