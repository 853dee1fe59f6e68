"""The corpus preparation's command line, `python -m data_prep.prepare` (the code: resformer_jax/data_prep/)."""
