"""Is an optional package here, and does it work?

flash-attn, bitsandbytes, tensorboard and wandb are optional. Not installed: the feature is off (where it was asked
for, one line says what to pip install). Installed but broken, typically a wheel built for another torch or CUDA: one
line says so and what is used instead, and the run goes on.
"""

import importlib
import importlib.util


def installed(package) -> bool:
    """Whether `package` (a top-level name) is installed, without importing it."""
    try:
        return importlib.util.find_spec(package) is not None
    except ValueError:  # sys.modules maps it to None: blocked, as good as absent
        return False


def load(module, instead):
    """`module` imported, or None: when its package is not installed, silently; when it is installed but does not
    import, after one line naming the error and `instead`, what runs in its place."""
    try:
        return importlib.import_module(module)
    except Exception as e:  # an ImportError, or an OSError from a binary built for another torch or CUDA
        if installed(module.split(".")[0]):
            print(f"{module.split('.')[0]} is installed but does not import ({type(e).__name__}: {e}); {instead}")
        return None
