"""The hardware a run can be compiled for from this machine (compilation/aot.py): TPU slices and NVIDIA GPU nodes.

Its notes (the reasons, what was measured): docs/modules.md.
"""

from __future__ import annotations

import dataclasses
import importlib.resources
import math
import os
import re
from typing import Any

from jax.experimental import topologies

from resformer_jax.chips import GIB, chip_named, gpu_target
from resformer_jax.errors import UserError


class TargetError(UserError, ValueError):
    """A compile target this project cannot name or build; the message lists the known ones."""


@dataclasses.dataclass(frozen=True)
class TpuChip:
    topology_prefix: str  # libtpu's generation name in "v5e:2x4"
    chip_config: str  # "megacore": one device per chip (two TensorCores); "default": one core per chip
    dims: int  # 2D or 3D slices
    cores_in_name: bool  # "v5p-64" counts TensorCores (2 per chip); "v5e-8" counts chips
    hbm_bytes: int  # per chip (= per JAX device)
    kind: str


def _tpu(topology_prefix: str, chip_config: str, dims: int, cores_in_name: bool, kind: str) -> TpuChip:
    """A TPU generation's topology facts here; its memory from the one chip table (chips.py)."""
    chip = chip_named(kind)
    assert chip is not None and chip.hbm_bytes, kind
    return TpuChip(topology_prefix, chip_config, dims, cores_in_name, chip.hbm_bytes, kind)


TPU_CHIPS = {
    "v4": _tpu("v4", "megacore", 3, True, "TPU v4"),
    "v5p": _tpu("v5", "megacore", 3, True, "TPU v5p"),
    "v5e": _tpu("v5e", "default", 2, False, "TPU v5e"),
    "v6e": _tpu("v6e", "default", 2, False, "TPU v6e"),
}
TPU_ALIASES = {"v5litepod": "v5e", "v5lite": "v5e", "v5": "v5p"}
# chips -> slice shape (Cloud TPU's topologies for each count)
SHAPES_3D = {
    4: (2, 2, 1),
    8: (2, 2, 2),
    16: (2, 2, 4),
    32: (2, 4, 4),
    64: (4, 4, 4),
    128: (4, 4, 8),
    256: (4, 8, 8),
    512: (8, 8, 8),
    1024: (8, 8, 16),
    2048: (8, 16, 16),
    4096: (16, 16, 16),
}
SHAPES_2D = {1: (1, 1), 4: (2, 2), 8: (2, 4), 16: (4, 4), 32: (4, 8), 64: (8, 8), 128: (8, 16), 256: (16, 16)}


# JAX's GPU allocator takes this fraction of the card unless XLA_PYTHON_CLIENT_MEM_FRACTION says otherwise
# (XLA_PYTHON_CLIENT_PREALLOCATE=false still caps at the card's memory).
JAX_GPU_MEM_FRACTION = 0.75

KNOWN = (
    "TPU: v4-N, v5p-N (N TensorCores, two per chip: v5p-8 is 4 chips), v5e-N, v6e-N (N chips), or libtpu's "
    "GEN:AxB[xC] (e.g. v5e:2x4); --slices for multislice. GPU: h100xN, h200xN, a100xN (N GPUs a node, "
    "at most 8); --nodes for several nodes"
)


@dataclasses.dataclass(frozen=True)
class Target:
    name: str  # as the user wrote it
    platform: str  # "tpu" | "cuda"
    kind: str  # the chip, in words
    num_devices: int
    hbm_bytes: int  # per device, what the program may use
    hbm_source: str
    # TPU
    topology_name: str = ""
    chip_config: str = ""
    chips_per_host_bounds: tuple = ()
    wrap: tuple = ()
    num_slices: int = 1
    # GPU
    spec_file: str = ""
    nodes: int = 1
    gpus_per_node: int = 0

    @property
    def hardware(self) -> str:
        """The hardware in words, e.g. '8x NVIDIA H100 SXM 80GB' or 'TPU v5p slice v5:2x4x4 (32 chips)'."""
        if self.platform == "cuda":
            nodes = f" on each of {self.nodes} nodes" if self.nodes > 1 else ""
            return f"{self.gpus_per_node}x {self.kind}{nodes}"
        slices = f" x {self.num_slices} slices" if self.num_slices > 1 else ""
        return f"{self.kind} slice {self.topology_name} ({self.num_devices // self.num_slices} chips){slices}"

    def target_config(self) -> str:
        """The GPU target config text (gpu_specs/)."""
        return importlib.resources.files("resformer_jax.compilation").joinpath("gpu_specs", self.spec_file).read_text()

    def devices(self) -> list:
        """Compile-only devices of this hardware, in the order a real run's jax.devices() lists them."""
        if self.platform == "tpu":
            # libtpu asks the (absent) GCE metadata server what it runs on unless told it is not a TPU VM.
            os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
            # compile-only: no chip is opened, so two compiles at once (two commands, two test workers) may each
            # load libtpu, which otherwise refuses the second through its multi-process lockfile
            os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
            hosts: dict[str, Any] = dict(
                chips_per_host_bounds=self.chips_per_host_bounds, num_slices=self.num_slices, wrap=self.wrap
            )
            topo = topologies.get_topology_desc(
                platform="tpu", topology_name=self.topology_name, chip_config_name=self.chip_config, **hosts
            )
        else:
            topo = topologies.get_topology_desc(
                platform="cuda", target_config=self.target_config(), topology=f"1x{self.nodes}x{self.gpus_per_node}"
            )
        devices = list(topo.devices)
        if len(devices) != self.num_devices:
            raise TargetError(
                f"target {self.name}: the topology has {len(devices)} devices, expected {self.num_devices}"
            )
        return devices


def _gpu_memory(spec_text: str) -> int:
    m = re.search(r"device_memory_size:\s*(\d+)", spec_text)
    if m is None:
        raise TargetError("the GPU's XLA target config gives no device_memory_size; compilation/gpu_specs/ is damaged")
    return int(m.group(1))


def parse_target(name: str, *, nodes: int = 1, slices: int = 1) -> Target:
    """A target from its name (see KNOWN); raises TargetError naming the known forms."""
    raw = name.strip().lower()
    if nodes < 1 or slices < 1:
        raise TargetError(f"--nodes={nodes} / --slices={slices}: both must be >= 1")
    gpu = re.fullmatch(r"([a-z]\d+)x(\d+)", raw)
    if gpu and gpu_target(gpu.group(1)) is not None:
        if slices != 1:
            raise TargetError(f"--slices is for TPU multislice; for several GPU nodes use --nodes (got {name})")
        model, per_node = gpu_target(gpu.group(1)), int(gpu.group(2))
        assert model is not None
        if not 1 <= per_node <= 8:
            raise TargetError(f"{name}: {per_node} GPUs a node; an NVLink node has 1 to 8 (use --nodes for more)")
        layout: dict[str, Any] = dict(spec_file=model.spec_file, nodes=nodes, gpus_per_node=per_node)
        t = Target(name, "cuda", model.kind, per_node * nodes, 0, "", **layout)
        fraction = float(os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", JAX_GPU_MEM_FRACTION))
        card = _gpu_memory(t.target_config())
        source = f"{fraction:.0%} of its {card / GIB:.2f} GiB, JAX's GPU allocator default"
        return dataclasses.replace(
            t, hbm_bytes=int(card * fraction), hbm_source=f"{source}; XLA_PYTHON_CLIENT_MEM_FRACTION changes it"
        )
    if nodes != 1:
        raise TargetError(f"--nodes is for GPU targets ({name} is not one); a TPU slice's size is in its name")
    libtpu = re.fullmatch(r"([a-z0-9]+):(\d+(?:x\d+){1,2})", raw)
    short = re.fullmatch(r"([a-z0-9]+?)-(\d+)", raw)
    found = libtpu or short
    if found is not None:
        gen = found.group(1)
        gen = TPU_ALIASES.get(gen, gen)
        if gen not in TPU_CHIPS:
            raise TargetError(f"unknown TPU generation {gen!r} in {name!r}; known: {KNOWN}")
        chip = TPU_CHIPS[gen]
        if libtpu:
            dims = tuple(int(d) for d in libtpu.group(2).split("x"))
        else:
            n = int(found.group(2))
            chips = n // 2 if chip.cores_in_name else n
            if chip.cores_in_name and n % 2:
                raise TargetError(f"{name}: {gen} names count TensorCores, two per chip; use an even number")
            table = SHAPES_3D if chip.dims == 3 else SHAPES_2D
            if chips not in table:
                raise TargetError(
                    f"{name}: no {gen} slice has {chips} chips; known sizes: "
                    + ", ".join(f"{gen}-{c * 2 if chip.cores_in_name else c}" for c in table)
                )
            dims = table[chips]
        if len(dims) != chip.dims:
            raise TargetError(f"{name}: {gen} slices are {chip.dims}-D (e.g. {gen}:{'x'.join(['2'] * chip.dims)})")
        count = math.prod(dims)
        bounds = (1, 1, 1) if count == 1 else (2, 2, 1)
        # A 3-D slice whose sides are all multiples of 4 is a torus (wraparound links) in Cloud TPU.
        wrap = tuple(chip.dims == 3 and all(d % 4 == 0 for d in dims) for _ in range(3))
        topology = f"{chip.topology_prefix}:{'x'.join(map(str, dims))}"
        hosts: dict[str, Any] = dict(
            chip_config=chip.chip_config, chips_per_host_bounds=bounds, wrap=wrap, num_slices=slices
        )
        memory = (chip.hbm_bytes, f"{chip.kind}'s HBM per chip")
        return Target(name, "tpu", chip.kind, count * slices, *memory, topology_name=topology, **hosts)
    raise TargetError(f"unknown target {name!r}; known: {KNOWN}")
