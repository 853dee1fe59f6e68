"""`resformer COMMAND [flags]` (the console script pyproject.toml installs) and `python -m resformer_jax COMMAND`:
one entry point, so `resformer --help` lists every command, each command keeps its own absl flags and --help."""

import importlib
import sys

from resformer_jax.errors import EXIT_USER_ERROR

# (command, module under resformer_jax.commands, what it does)
COMMANDS = (
    ("prepare", "prepare", "raw text tokenized and packed into ArrayRecord shards (= python -m data_prep.prepare)"),
    ("train", "main", "pretrain, resume, or print a config's summary (python -m resformer_jax.main is the same)"),
    ("evaluate", "evaluate", "validation loss per domain, zero-shot multiple choice"),
    ("generate", "generate", "sample from a run with the KV-cache decode"),
    ("analyze", "analyze", "the paper's per-layer measures (entropy, similarity, spectra) of runs or HF models"),
    ("compare", "compare", "group runs by a config field: relative curves, per-domain gaps, scaling fits"),
    ("sweep", "sweep", "a grid of runs: locally, as a SLURM array or a TPU-pod script"),
    ("compile", "compile", "compile a config for a TPU slice or GPU node from this machine: memory, roofline"),
    ("bench", "bench", "benchmarks: train step, decode, data, attention, zero-shot, the accelerator check"),
    ("serve", "serve", "an OpenAI-compatible HTTP server on the decode engine (the serve extra)"),
    ("export", "export", "a run as a Hugging Face checkpoint"),
    ("harness", "harness", "lm-evaluation-harness on a run (lm-eval's own flags)"),
    ("tfds-build", "tfds_build", "a prepared corpus as a TensorFlow Datasets dataset"),
    ("lm-eval-tasks", "lm_eval_tasks", "lm-eval task configs for a folder of local task files"),
)


def usage() -> str:
    width = max(len(name) for name, _, _ in COMMANDS)
    rows = "\n".join(f"  {name:<{width}}  {what}" for name, _, what in COMMANDS)
    return f"usage: resformer COMMAND [flags]   (COMMAND --help for its flags)\n\ncommands:\n{rows}\n"


def run(name: str, argv: list[str]) -> None:
    """Runs command `name` with `argv` (its flags) as if it were the program."""
    modules = {command: module for command, module, _ in COMMANDS}
    if name not in modules:
        sys.stderr.write(f"resformer: unknown command {name!r}.\n\n{usage()}")
        sys.exit(EXIT_USER_ERROR)
    from resformer_jax.runtime import prepare_command_process

    prepare_command_process()  # before the command imports JAX: it may restart the process once
    module = importlib.import_module(f"resformer_jax.commands.{modules[name]}")
    sys.argv = [f"resformer {name}", *argv]
    sys.modules["__main__"].__doc__ = module.__doc__  # absl's --help prints the program's docstring
    module.cli_main()


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help", "help"):
        sys.stdout.write(usage())
        sys.exit(0 if len(sys.argv) >= 2 else 2)
    run(sys.argv[1], sys.argv[2:])
