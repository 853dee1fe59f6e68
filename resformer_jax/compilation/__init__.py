"""Compiling a run for hardware that is not this machine (TPU slices, NVIDIA GPU nodes) and reading the compiled
program: targets.py (the hardware), aot.py (the compile, its memory and fit), roofline.py (the program's own bound on
step time and MFU from its HLO), ptxas.py (GPU kernels' registers and spills). The command is commands/compile.py;
`resformer compile` and `resformer compile` run it."""
