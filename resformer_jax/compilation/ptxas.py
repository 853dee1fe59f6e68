"""Registers and spills of the Triton kernels in a program compiled for a GPU, from ptxas (the aot extra installs
it): the compile command dumps the program's PTX (XLA's xla_dump_to, per compile) and asks `ptxas -v` what each
Pallas kernel uses on the target GPU, so a kernel that spills registers to local memory shows before any GPU time
is spent."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import glob
import importlib.util
import os
import re
import shutil
import subprocess

# The GPU architecture ptxas compiles for, per target GPU (H100/H200: sm_90a, as XLA emits; A100: sm_80).


@dataclasses.dataclass(frozen=True)
class KernelResources:
    kernel: str
    registers: int
    spill_store_bytes: int
    spill_load_bytes: int
    stack_bytes: int

    @property
    def spills(self) -> bool:
        return self.spill_store_bytes > 0 or self.spill_load_bytes > 0


def find_ptxas() -> str | None:
    """ptxas from the nvidia-cuda-nvcc wheel (the aot extra), else from PATH."""
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        path = os.path.join(root, "cuda_nvcc", "bin", "ptxas")
        if os.path.isfile(path):
            return path
    return shutil.which("ptxas")


def parse_ptxas(text: str) -> list[KernelResources]:
    """`ptxas -v`'s report: per entry function, registers, spill stores and loads, stack frame."""
    out = []
    for block in re.split(r"(?=ptxas info\s*: Compiling entry function)", text):
        name = re.search(r"Compiling entry function '([^']+)'", block)
        regs = re.search(r"Used (\d+) registers", block)
        if not name or not regs:
            continue
        spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", block)
        stack = re.search(r"(\d+) bytes stack frame", block)
        out.append(
            KernelResources(
                name.group(1),
                int(regs.group(1)),
                int(spill.group(1)) if spill else 0,
                int(spill.group(2)) if spill else 0,
                int(stack.group(1)) if stack else 0,
            )
        )
    return out


def kernel_resources(dump_dir: str, kernels: set[str], arch: str, ptxas: str | None = None) -> list[KernelResources]:
    """Each named kernel's resources, from the PTX files XLA dumped into `dump_dir`."""
    ptxas = ptxas or find_ptxas()
    if ptxas is None:
        return []

    def named(entry: str) -> bool:  # XLA names a second kernel of the same name NAME__1, NAME__2, ...
        return re.sub(r"__\d+$", "", entry) in kernels

    paths = []
    for path in sorted(glob.glob(os.path.join(dump_dir, "*.ptx"))):
        with open(path, errors="replace") as f:
            if any(named(e) for e in re.findall(r"\.entry\s+([\w$]+)", f.read())):
                paths.append(path)

    def report(path: str) -> str:
        r = subprocess.run(
            [ptxas, f"-arch={arch}", "-v", path, "-o", os.devnull], capture_output=True, text=True, timeout=300
        )
        return r.stdout + r.stderr

    # one ptxas per file, on every core: a program's files are independent
    with concurrent.futures.ThreadPoolExecutor(max_workers=max(1, min(len(paths), os.cpu_count() or 1))) as pool:
        return [k for text in pool.map(report, paths) for k in parse_ptxas(text) if named(k.kernel)]
