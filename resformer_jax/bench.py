"""`python -m resformer_jax.bench`, the same as `resformer bench` (commands/bench.py; the benchmarks: benchmarks/)."""

if __name__ == "__main__":
    import sys

    from resformer_jax.commands.cli import run

    run("bench", sys.argv[1:])
