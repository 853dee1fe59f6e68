"""`python -m resformer_jax.harness`, kept at the path README and scripts use; the command is resformer_jax/commands/harness.py."""
if __name__ == "__main__":
    from resformer_jax.commands.harness import __doc__, cli_main  # noqa: F401 - its docstring is the usage --help prints
    cli_main()
