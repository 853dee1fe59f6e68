"""`python -m resformer_jax.compile`, the same as `resformer compile` (commands/compile.py; the compilers:
compilation/)."""

if __name__ == "__main__":
    import sys

    from resformer_jax.commands.cli import run

    run("compile", sys.argv[1:])
