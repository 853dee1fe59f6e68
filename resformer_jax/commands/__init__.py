"""Every entry point, and only they: each parses its flags (absl; `harness` passes lm-eval's own), calls the
library, and turns a `UserError` into one line on stderr and its exit code (common.py). Nothing in the library
imports this folder; `python -m resformer_jax.main`, `.bench` and `.compile` are two-line entry files that run
their command through cli.run. Importing a command changes nothing: cli.run prepares the process first
(`runtime.prepare_command_process`)."""
