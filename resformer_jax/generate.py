"""`python -m resformer_jax.generate`, kept at the path README and scripts use; the command is resformer_jax/commands/generate.py."""
if __name__ == "__main__":
    from resformer_jax.commands.generate import __doc__, cli_main  # noqa: F401 - its docstring is the usage --help prints
    cli_main()
