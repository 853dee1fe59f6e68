"""The benchmarks, one module each, over one timing helper (timing.py); `resformer bench NAME`
runs them (commands/bench.py, whose table maps each subcommand to its module here).

  train        train.py        the compiled train step as training builds it: step time, tokens/s, MFU, memory,
                               the step's time by group (step_profile.py)
  attention    attention.py    every attention impl, forward and forward+backward
  decode       decode.py       KV-cached decoding, and the batch x context matrix against memory bandwidth
  data         data.py         the training input pipeline's tokens/s against what the step consumes
  accelerator  accelerator.py  the first thing to run on new hardware: all of the above, checked and reported
"""
