"""`python -m resformer_jax.sweep`, kept at the path README and scripts use; the command is resformer_jax/commands/sweep.py."""
if __name__ == "__main__":
    from resformer_jax.commands.sweep import __doc__, cli_main  # noqa: F401 - its docstring is the usage --help prints
    cli_main()
