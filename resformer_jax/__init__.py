"""resformer_jax: pretraining value-residual transformers (ResFormer, SVFormer) in JAX/Flax.

Its notes (the reasons, what was measured): docs/modules.md.
"""

import time

__version__ = "0.1.0"

# When this interpreter first imported the package, about its own start: the goodput ledger's start-up begins here,
# not at the process's creation (a shell that prepares something and then execs Python has the same process).
IMPORTED_UNIX = time.time()
