"""`resformer bench NAME [flags]`, the same as `resformer bench NAME`."""

import sys

from resformer_jax.commands.cli import run

run("bench", sys.argv[1:])
