"""`python -m resformer_jax.bench [flags]`, the same as `resformer bench`: the package's own entry point runs it (this
folder, a library floor, imports no command)."""

import runpy
import sys

sys.argv = [sys.argv[0], "bench", *sys.argv[1:]]
runpy.run_module("resformer_jax", run_name="__main__")
