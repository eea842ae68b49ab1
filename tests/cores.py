"""This test process's share of the machine's cores, imported by conftest.py before torch loads.

Under pytest-xdist (the README's `-n 2`) the process is one of WORKERS test workers on the machine. Its torch threads,
and those of the torch processes its tests start (they inherit OMP_NUM_THREADS), share its part of the cores: a thread
that waits for a core holds up its process at every barrier. A value the user set wins.
"""

import os

WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
CORES = max(1, len(os.sched_getaffinity(0)) // WORKERS)
if WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(CORES))
