"""lm-evaluation-harness's command line with this project's model registered as `resformer_jax`.

  resformer harness --model resformer_jax --model_args workdir=RUN[,step=S,batch_size=N] \\
      --tasks piqa_local,arc_easy_local,arc_challenge_local,hellaswag_local,winogrande_local,openbookqa_local \\
      --include_path configs/lm_eval_tasks

Every lm_eval flag works as with `lm_eval`. (lm-eval 0.4 discovers models only among its own modules, so the
stock `lm_eval` command cannot see a model that lives in another package; this command imports the adapter,
resformer_jax/eval/lm_eval_model.py, and then runs lm-eval's own CLI.)
"""

from __future__ import annotations

import importlib.util
import sys


def cli_main():
    from resformer_jax.commands import common as cli

    if importlib.util.find_spec("lm_eval") is None and any(a in cli.HELP_FLAGS for a in sys.argv[1:]):
        sys.stdout.write(
            cli.command_help(sys.modules[__name__])
            + "\nThe flags are lm-eval's own (lm_eval --help); running needs the lm_eval extra, not installed here: "
            "pip install -e '.[lm_eval]'\n"
        )
        sys.exit(0)
    cli.start()

    if importlib.util.find_spec("lm_eval") is None:
        cli.fail("the harness needs lm-evaluation-harness, which is not installed; pip install -e '.[lm_eval]'")
    from lm_eval.__main__ import cli_evaluate

    if sys.argv[1:] in (["--help"], ["-h"]):  # this command's own words first, then lm-eval's flags
        sys.stdout.write(cli.command_help(sys.modules[__name__]).replace("(no flags)", "lm-eval's own flags:") + "\n")
        sys.stdout.flush()

    import resformer_jax.eval.lm_eval_model  # noqa: F401 - registers the model "resformer_jax"
    from resformer_jax.load import check_model_path

    with cli.exit_on_user_error():  # the adapter's errors (a missing run, no tokenizer) as one line
        workdir = _model_arg(sys.argv[1:], "workdir")
        if workdir:  # a missing run is named before lm-eval spends seconds indexing its tasks
            check_model_path(workdir)
        cli_evaluate()


def _model_arg(argv: list[str], key: str) -> str | None:
    """`key`'s value in lm-eval's `--model_args k=v,k=v` (or `--model_args=...`), None where absent."""
    for i, a in enumerate(argv):
        if a.startswith("--model_args="):
            value = a.split("=", 1)[1]
        elif a == "--model_args" and i + 1 < len(argv):
            value = argv[i + 1]
        else:
            continue
        return dict(p.split("=", 1) for p in value.split(",") if "=" in p).get(key)
    return None
