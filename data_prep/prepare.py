"""`python -m data_prep.prepare --input RAW --tokenizer TOK --out DIR`: the command line of the corpus preparation,
which lives in the package (resformer_jax/data_prep/prepare.py) beside the data pipeline that reads its output."""

import sys

from resformer_jax.data_prep.prepare import main

if __name__ == "__main__":
    sys.exit(main())
