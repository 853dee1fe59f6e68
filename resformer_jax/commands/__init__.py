"""Every entry point, and only they: each parses its flags (absl; `harness` passes lm-eval's own), calls the
library, and turns a `UserError` into one line on stderr and its exit code (common.py). Nothing in the library
imports this folder; `python -m resformer_jax.main`, `.bench` and `.compile` are two-line entry files that run
their command here."""

from resformer_jax.runtime import quiet_absent_accelerators, restart_with_host_memory_defaults

# First, before a command imports JAX: on a CPU host the process restarts once with huge pages for XLA's buffers
# (runtime.py says why); a library caller that imports a command module is never restarted.
restart_with_host_memory_defaults()
# Then, on a host without GPU or TPU, the accelerator plugins the aot extra installs are kept quiet.
quiet_absent_accelerators()
