"""Registers a prepared corpus as a TensorFlow Datasets builder (ArrayRecord, no TensorFlow needed).

resformer tfds-build --data=DIR     # DIR written by data_prep.prepare
"""

from __future__ import annotations

import sys

from absl import flags

from resformer_jax.commands import common as cli

flags.DEFINE_string("data", None, "A folder written by data_prep.prepare.", required=True)
FLAGS = flags.FLAGS


def main(argv):
    cli.start()
    # Import by name: tfds resolves a builder's files through its module, which must not be __main__.
    from resformer_jax.data import tfds_source

    with cli.exit_on_user_error():
        print(tfds_source.build(FLAGS.data))


def cli_main():
    cli.run_app(main, sys.modules[__name__])
