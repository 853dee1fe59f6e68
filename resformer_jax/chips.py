"""Every accelerator fact the project uses, in one table: MFU's peak (perf.py), the roofline's FLOP/s and bytes/s
(compilation/roofline.py), the compile targets' memory and XLA spec (compilation/targets.py), ptxas' architecture
(compilation/ptxas.py) and the Pallas kernel's shared-memory budget (kernels/pallas_attention.py). A new chip is one
row here (and, for a GPU compile target, its XLA spec file in compilation/gpu_specs/)."""

from __future__ import annotations

import dataclasses

GIB = 2**30


@dataclasses.dataclass(frozen=True)
class Chip:
    """One device's datasheet numbers. `kind` is the canonical name (a compile target's, what the roofline
    prints); `matches` the substrings of JAX's `device_kind` that name it (first row that matches wins)."""

    kind: str
    matches: tuple[str, ...]
    peak_flops: float  # dense bf16 FLOP/s
    # 0 / "": not known (a chip listed for MFU's peak alone)
    hbm_bytes_per_s: float = 0.0
    link_bytes_per_s: float = 0.0  # interconnect, each way
    hbm_bytes: int = 0  # what one device's program may use (a TPU chip's; a GPU's comes from its XLA spec)
    smem_bytes_per_block: int = 0  # GPU: opt-in shared memory a kernel block may use
    arch: str = ""  # GPU: ptxas' target architecture
    spec_file: str = ""  # GPU compile target: its XLA target config in compilation/gpu_specs/
    target: str = ""  # GPU compile target's name prefix (h100 in h100x8)
    source: str = ""  # where the roofline's numbers come from

    @property
    def has_roofline(self) -> bool:
        """Whether the roofline can bound a program on it (FLOP/s, memory and interconnect bandwidth known)."""
        return self.hbm_bytes_per_s > 0 and self.link_bytes_per_s > 0


HOPPER_SMEM, AMPERE_SMEM = 227 * 1024, 163 * 1024  # CUDA's per-architecture opt-in limits per block

CHIPS: tuple[Chip, ...] = (
    Chip(
        "NVIDIA H200 SXM 141GB",
        ("H200",),
        989e12,
        4.8e12,
        450e9,
        smem_bytes_per_block=HOPPER_SMEM,
        arch="sm_90a",
        spec_file="h200_sxm.txtpb",
        target="h200",
        source="NVIDIA H200 datasheet (SXM): 989 TFLOP/s dense BF16, 4.8 TB/s HBM3e, NVLink 900 GB/s",
    ),
    Chip(
        "NVIDIA H100 SXM 80GB",
        ("H100",),
        989e12,
        3.35e12,
        450e9,
        smem_bytes_per_block=HOPPER_SMEM,
        arch="sm_90a",
        spec_file="h100_sxm.txtpb",
        target="h100",
        source="NVIDIA H100 datasheet (SXM5): 989 TFLOP/s dense BF16, 3.35 TB/s HBM3, NVLink 900 GB/s",
    ),
    Chip("NVIDIA H800", ("H800",), 989e12, smem_bytes_per_block=HOPPER_SMEM, arch="sm_90a"),
    Chip(
        "NVIDIA A100 SXM 80GB",
        ("A100",),
        312e12,
        2.039e12,
        300e9,
        smem_bytes_per_block=AMPERE_SMEM,
        arch="sm_80",
        spec_file="a100_sxm_80gb.txtpb",
        target="a100",
        source="NVIDIA A100 datasheet (SXM 80GB): 312 TFLOP/s dense BF16, 2,039 GB/s, NVLink 600 GB/s",
    ),
    Chip("NVIDIA A800", ("A800",), 312e12, smem_bytes_per_block=AMPERE_SMEM, arch="sm_80"),
    Chip("NVIDIA L40S", ("L40S",), 362e12),
    Chip("NVIDIA A10G", ("A10G",), 125e12),
    Chip("NVIDIA L4", ("L4",), 121e12),
    Chip("NVIDIA V100", ("V100",), 125e12),
    Chip("NVIDIA RTX 4090", ("RTX 4090",), 165e12),
    Chip(
        "TPU v6e",
        ("TPU v6",),
        918e12,
        1.64e12,
        448e9,
        hbm_bytes=32 * GIB,
        source="Cloud TPU v6e docs: 918 TFLOP/s BF16, 1,640 GB/s HBM, ICI 3,584 Gbps",
    ),
    Chip(
        "TPU v5p",
        ("TPU v5p",),
        459e12,
        2.765e12,
        600e9,
        hbm_bytes=95 * GIB,
        source="Cloud TPU v5p docs: 459 TFLOP/s BF16, 2,765 GB/s HBM, ICI 4,800 Gbps",
    ),
    Chip(
        "TPU v5e",
        ("TPU v5 lite", "TPU v5e"),
        197e12,
        0.819e12,
        200e9,
        hbm_bytes=int(15.75 * GIB),  # 16 GiB a chip, of which libtpu's compiler reports 15.75 available
        source="Cloud TPU v5e docs: 197 TFLOP/s BF16, 819 GB/s HBM, ICI 1,600 Gbps",
    ),
    Chip("TPU v5", ("TPU v5",), 459e12),  # JAX's name for a v5p on some releases
    Chip(
        "TPU v4",
        ("TPU v4",),
        275e12,
        1.228e12,
        300e9,
        hbm_bytes=32 * GIB,
        source="Cloud TPU v4 docs: 275 TFLOP/s BF16, 1,228 GB/s HBM, ICI 2,400 Gbps",
    ),
    Chip("TPU v3", ("TPU v3",), 123e12),
)


def chip_named(kind: str) -> Chip | None:
    """The row whose canonical name is `kind` (a compile target's chip)."""
    return next((c for c in CHIPS if c.kind == kind), None)


def chip_of_device(device_kind: str) -> Chip | None:
    """The row for JAX's `device.device_kind` ("NVIDIA H100 80GB HBM3", "TPU v5 lite"), None where none matches."""
    low = device_kind.lower()
    return next((c for c in CHIPS if any(m.lower() in low for m in c.matches)), None)


def gpu_target(prefix: str) -> Chip | None:
    """The GPU compile target named `prefix` (h100 in h100x8)."""
    return next((c for c in CHIPS if c.target == prefix), None)
