"""`python -m resformer_jax.main`, the headline command (the same as `resformer train`): commands/main.py."""

if __name__ == "__main__":
    from resformer_jax.commands.main import __doc__, cli_main  # noqa: F401 - its docstring is the usage --help prints

    cli_main()
