"""The scale-out presets' compile table (docs/scaling-out.md): a row per preset, variant and cluster, each from the
JSON line `resformer compile` printed for it (`resformer compile --scale_table=DIR` makes them and prints this).

Its notes (the reasons, what was measured): docs/scaling-out.md.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

from resformer_jax.presets import CLUSTERS, SCALE_MODELS, SCALE_SETTINGS

VARIANTS = (("transformer", "none"), ("resformer", "resformer"), ("svformer", "svformer"))
HEADROOM = 0.10  # a row fits when this share of the device's memory stays free (compile --tune's rule)
# Several GPU nodes: the links between nodes (400 Gb/s InfiniBand a GPU, as on DGX H100) against NVLink's 900 GB/s;
# the roofline counts every collective byte at NVLink's speed, so a row also says the time were they all between nodes.
INTER_NODE_BYTES_PER_S = 50e9


@dataclasses.dataclass(frozen=True)
class Row:
    """One compiled preset: `config` is the --config it was compiled from."""

    size: str
    file: str  # transformer | resformer | svformer
    cluster: str

    @property
    def config(self) -> str:
        return f"configs/{self.file}_{self.size}.py:{self.cluster}"

    @property
    def name(self) -> str:
        return f"{self.file}_{self.size}_{self.cluster}"

    def command(self) -> list[str]:
        s = SCALE_SETTINGS[self.size, self.cluster]
        nodes = [f"--nodes={s.nodes}"] if s.nodes > 1 else []
        return ["compile", f"--config={self.config}", f"--target={s.target}", *nodes, "--steps=train"]


def rows(sizes=tuple(SCALE_MODELS), clusters=CLUSTERS) -> list[Row]:
    return [Row(size, file, c) for size in sizes for file, _ in VARIANTS for c in clusters]


def read(path: pathlib.Path) -> dict | None:
    """A row's compile report (the command's last JSON line), None where it is missing or was cut short."""
    if not path.exists():
        return None
    lines = [ln for ln in path.read_text().splitlines() if ln.startswith("{")]
    try:
        return json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        return None


def fits_with_headroom(report: dict) -> bool:
    train = report["steps"][0]
    return report["fits"] and train["memory_per_device"]["total"] <= (1 - HEADROOM) * report["device_memory_bytes"]


def markdown(reports: dict[Row, dict | None]) -> list[str]:
    """The table's lines; a row not compiled says so."""
    head = (
        "| preset | variant | cluster | mesh (data x fsdp) | sequences a device a microbatch | remat | memory a device "
        "(free) | step bound | MFU ceiling | collectives a device (share of the bound) | tokens/s at the bound | "
        "days to the budget (at 0.6 of the bound) |"
    )
    out = [head, "|" + "---|" * (head.count("|") - 1)]
    for row, rep in reports.items():
        lead = f"| {row.size} | {row.file} | {row.cluster} |"
        if rep is None:
            out.append(lead + " not compiled |" + " |" * 9)
            continue
        train = rep["steps"][0]
        mem, hbm = train["memory_per_device"]["total"], rep["device_memory_bytes"]
        r, b = train.get("roofline") or {}, rep.get("at_the_bound") or {}
        mesh = rep["mesh"]
        per_device = rep["microbatch"] // max(1, mesh["data"] * mesh["fsdp"])
        bound = r.get("per_op_bound_s") or 0.0
        coll_bytes = r.get("collective_bytes_per_device") or 0.0
        coll_s = (r.get("by_kind", {}).get("collective") or {}).get("bound_s", 0.0)
        share = f"{coll_bytes / 1e9:.1f} GB ({coll_s / bound:.0%}" if bound else "-"
        if bound and SCALE_SETTINGS[row.size, row.cluster].nodes > 1:
            share += f"; {coll_bytes / INTER_NODE_BYTES_PER_S / bound:.0%} were all of it between nodes"
        share += ")" if bound else ""
        verdict = "" if fits_with_headroom(rep) else " **does not fit with 10% free**"
        layers = "" if SCALE_SETTINGS[row.size, row.cluster].scan_layers else ", layers unrolled"
        out.append(
            f"{lead} {mesh['data']} x {mesh['fsdp']} | {per_device} | {rep['remat']}{layers} | {mem / 2**30:.1f} GiB "
            f"({1 - mem / hbm:.0%} of {hbm / 2**30:.0f}){verdict} | {bound:.2f} s | "
            f"{r.get('mfu_ceiling_model') or 0:.3f} | {share} | {b.get('tokens_per_s', 0):,.0f} | "
            f"{b.get('days', 0):.1f} ({b.get('days_at_0_6', 0):.1f}) |"
        )
    return out
