"""Relative training loss against a baseline (the paper's Fig. 5 / Fig. 1 left), for runs or for groups of seeds.

  resformer compare --baseline RUN_VANILLA RUN_A RUN_B ... [--smooth 100] --out DIR
  resformer compare runs/sweep82m --group_by model.value_residual --baseline none [--out DIR]
  resformer compare runs/sizes --group_by model.value_residual --baseline none --scaling
  resformer compare --goodput runs/a runs/b      # where each run's wall time went, over its restarts

Grouped (--group_by FIELD): runs (run directories, or sweep directories holding them) are grouped by
any config field read from each run's config.json (seeds pooled); each group's mean smoothed training
loss is plotted relative to the baseline group with a band over seeds, and so is the validation loss
per domain; a table prints each group's final relative loss, its spread over seeds, and a verdict
(gap larger than the pooled seed noise or not). --scaling adds, for a sweep over model sizes, the
validation loss against parameters and against tokens with a power law fitted per group and the
"needs X% fewer parameters / tokens for the same loss" readout. See analysis/grouping.py.

Each run's training loss is smoothed with a trailing moving window, the
baseline's is subtracted at the steps both logged, and the result is plotted
to DIR/relative_train_loss.png and written as TensorBoard scalars
`relative/train_loss` under DIR/tb/<run name> (so `tensorboard --logdir DIR/tb`
shows the same curves) and as DIR/relative_train_loss.json.
"""

from __future__ import annotations

import sys

from absl import app, flags

from resformer_jax.analysis.compare import CompareOptions, goodput_table, grouped, pairwise
from resformer_jax.commands import common as cli
from resformer_jax.storage import run_path

flags.DEFINE_string("baseline", None, "The vanilla run; with --group_by, the baseline group's value (e.g. none).")
flags.DEFINE_string("group_by", None, "A config field (e.g. model.value_residual): compare groups.")
flags.DEFINE_bool("scaling", False, "With --group_by: loss against parameters and tokens.")
flags.DEFINE_enum(
    "scaling_loss",
    "train_last50",
    ["train_last50", "validation"],
    "--scaling: the loss plotted against "
    "parameters: the mean training loss of the last 50 training steps (paper Fig. 5 middle) or the "
    "final validation loss.",
)
flags.DEFINE_integer(
    "smooth",
    100,
    "Trailing moving-average window in training steps (whatever train.log_every "
    "was: with log_every=10 a 100-step window averages 10 logged points), as the paper's 100 steps.",
)
flags.DEFINE_string(
    "vs",
    None,
    "With --group_by: a field (e.g. data.seq_len) for Fig. 11 right: the step where the "
    "baseline overtakes each group, against that field.",
)
flags.DEFINE_integer(
    "last",
    1000,
    "--vs: the line that predicts a critical point is fitted over the last this many "
    "training steps (the paper: 1,000).",
)
flags.DEFINE_string("out", None, "Output folder (grouped default: FIRST_PATH/compare).")
flags.DEFINE_bool(
    "goodput", False, "Print where each run's wall time went (RUN/goodput.json, over its restarts); no --baseline."
)
FLAGS = flags.FLAGS


def check_flags(a) -> None:
    """Bad values stop before anything is read or written."""
    if a.smooth < 1:
        raise cli.ConfigFlagError(f"--smooth={a.smooth}: the moving-average window must be at least 1 point")
    if a.last < 2:
        raise cli.ConfigFlagError(f"--last={a.last}: the critical-point line needs at least 2 points")
    if not a.group_by and not a.out:
        raise cli.ConfigFlagError("--out is required without --group_by (the folder for the plot and logs)")
    if a.out and run_path(a.out).exists() and not run_path(a.out).is_dir():
        raise cli.ConfigFlagError(f"--out={a.out} is a file, not a folder; give a folder for the plots and logs")


def main(argv):
    cli.start()
    if FLAGS.goodput:
        if len(argv) < 2:
            raise app.UsageError("give the runs (or sweep directories) whose goodput to show")
        with cli.exit_on_user_error():
            return goodput_table(list(argv[1:]))
    if FLAGS.baseline is None:
        raise app.UsageError("--baseline is required: the vanilla run (with --group_by, the baseline group's value)")
    if len(argv) < 2:
        raise app.UsageError("give the runs to compare (with --group_by: runs or sweep directories)")
    names = ("baseline", "group_by", "scaling", "scaling_loss", "smooth", "vs", "last", "out")
    a = CompareOptions(runs=list(argv[1:]), **{k: FLAGS[k].value for k in names})
    with cli.exit_on_user_error():
        check_flags(a)
        return grouped(a) if a.group_by else pairwise(a)


def cli_main():
    cli.run_app(lambda argv: sys.exit(main(argv)), sys.modules[__name__])
