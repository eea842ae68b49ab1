"""How do torch's idle CPU threads wait? Imported by each entry point before torch, because OpenMP reads it only then.

torch runs a CPU op on OpenMP threads. Between two parallel regions, GNU OpenMP's idle threads spin (about 300,000
turns) before they sleep. On an idle machine that saves a wake-up; beside another busy process on a 2-core machine the
spinning thread holds a core that the other process, or torch's own working thread, needs, at every small op (a
decode step has hundreds). OMP_WAIT_POLICY=PASSIVE puts idle threads to sleep at once. libgomp reads the variable
once, when `import torch` loads it, so this module sets it first; a value the user set wins. Measurements in
docs/performance.md (a CPU run beside other work).
"""

import os

USER_WAIT_POLICY = os.environ.get("OMP_WAIT_POLICY")  # None: not set by the user, so set here
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
