"""Writes lm-eval task YAMLs for local copies of the zero-shot sets (give the folder to --include_path).

resformer lm-eval-tasks --task_data=DIR --out=configs/lm_eval_tasks
"""

from __future__ import annotations

import sys

from absl import flags

from resformer_jax.commands import common as cli

flags.DEFINE_string("task_data", None, "Folder with {task}.jsonl files (Hugging Face field names).", required=True)
flags.DEFINE_string("out", None, "Folder for the task YAMLs (give it to --include_path).", required=True)
FLAGS = flags.FLAGS


def main(argv):
    cli.start()
    from resformer_jax.eval.lm_eval_tasks import write_tasks

    with cli.exit_on_user_error():
        for path in write_tasks(FLAGS.task_data, FLAGS.out):
            print(path)


def cli_main():
    cli.run_app(main, sys.modules[__name__])
