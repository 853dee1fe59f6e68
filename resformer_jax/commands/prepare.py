"""Raw text -> packed, tokenized ArrayRecord shards per split and domain.

`python -m data_prep.prepare` by its command name, with the same flags (`resformer prepare --help` lists them):

  resformer prepare --input ../shared/data/slimpajama_sample --tokenizer train:4096 --out /tmp/sp4k --seq_len 256
"""

import sys


def cli_main():
    from resformer_jax.data_prep.prepare import main

    sys.exit(main(sys.argv[1:], prog="resformer prepare"))
