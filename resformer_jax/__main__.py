"""`python -m resformer_jax COMMAND [flags]`: the `resformer` console script without the script on PATH."""

from resformer_jax.commands.cli import main

main()
