"""The benchmarks, one module each, over one timing helper (timing.py); `resformer bench NAME`
runs them (commands/bench.py, whose table maps each subcommand to its module here).

Its notes (the reasons, what was measured): docs/modules.md.
"""
