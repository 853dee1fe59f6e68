"""`python -m resformer_jax.compile [flags]`, the same as `resformer compile`: the package's own entry point runs
it (this folder, a library floor, imports no command)."""

import runpy
import sys

sys.argv = [sys.argv[0], "compile", *sys.argv[1:]]
runpy.run_module("resformer_jax", run_name="__main__")
