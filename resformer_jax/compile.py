"""`python -m resformer_jax.compile`, the path README uses; the command is resformer_jax/commands/compile.py."""
if __name__ == "__main__":
    from resformer_jax.commands.compile import __doc__, cli_main  # noqa: F401 - its docstring is the usage --help prints
    cli_main()
