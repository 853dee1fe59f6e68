"""`python -m resformer_jax.export`, kept at the path README and scripts use; the command is resformer_jax/commands/export.py."""
if __name__ == "__main__":
    from resformer_jax.commands.export import __doc__, cli_main  # noqa: F401 - its docstring is the usage --help prints
    cli_main()
