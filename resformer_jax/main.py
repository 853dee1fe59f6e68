"""`python -m resformer_jax.main`, the headline command (the same as `resformer train`): commands/main.py."""

if __name__ == "__main__":
    import sys

    from resformer_jax.commands.cli import run

    run("train", sys.argv[1:])
