"""Every entry point, and only they: each parses its flags (absl; `harness` passes lm-eval's own), calls the
library, and turns a `UserError` into one line on stderr and its exit code (common.py). Nothing in the library
imports this folder; the `python -m resformer_jax.<command>` paths README shows are two-line modules that call
the command here."""
