"""`resformer compile [flags]`, the same as `resformer compile`."""

import sys

from resformer_jax.commands.cli import run

run("compile", sys.argv[1:])
