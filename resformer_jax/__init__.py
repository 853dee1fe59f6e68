"""resformer_jax: pretraining value-residual transformers (ResFormer, SVFormer) in JAX/Flax.

Commands on top (`commands/`), the library below, never importing a command: `model/` (the architecture, a
per-layer plan per paper equation) knows nothing of training, `data/` nothing of models, `train/` no file
formats; `rundir.py` owns a run directory, `errors.py` holds the one user-error type. README's Layout section
lists every folder.
"""

import time

__version__ = "0.1.0"

# When this interpreter first imported the package, about its own start: the goodput ledger's start-up begins here,
# not at the process's creation (a shell that prepares something and then execs Python has the same process).
IMPORTED_UNIX = time.time()
