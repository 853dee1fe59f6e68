"""The memory a train step needs against what a device has: the analytic estimate before anything is built
(`too_big_for_here`: a config sized for other hardware stops before the probe and the compile, saying what would fit),
the compiled step's own numbers after (`memory_precheck`), and what lowers them (`memory_knobs`). Read by the
trainer, the compile command and the benchmarks."""

from __future__ import annotations

import dataclasses
import os
import re

import jax

from resformer_jax import perf
from resformer_jax.config import RunConfig
from resformer_jax.errors import UserError
from resformer_jax.resolve import sequences_per_device


class MemoryPrecheckError(UserError, RuntimeError):
    """The compiled step needs more memory per device than there is; the message says what to change."""


def memory_knobs(cfg, devices: int) -> str:
    """What lowers a train step's memory per device on `devices` devices, leaving out knobs already at their
    limit; the trainer's precheck and the compile command (compilation/aot.py) say it."""
    knobs = []
    per_device = sequences_per_device(cfg, devices)
    if per_device > 1:
        knobs.append(
            f"lower config.train.microbatch (sequences per accumulation step: {per_device} a device now) "
            "or config.train.global_batch"
        )
    if cfg.model.remat != "full":
        knobs.append("use --config.model.remat=full")
    fsdp = perf.fsdp_devices(cfg, devices)
    if fsdp < devices:
        knobs.append(f"shard the state over more devices with config.mesh.fsdp (now {fsdp} of {devices})")
    if not knobs:
        return (
            f"it does not fit even with one sequence a device, remat=full and the state sharded over all "
            f"{devices} devices: use more devices, or a shorter config.data.seq_len or a smaller model"
        )
    return ", ".join(knobs[:-1]) + (" or " if len(knobs) > 1 else "") + knobs[-1]


def device_memory_limit(mesh_cfg) -> tuple[float | None, str]:
    """(bytes one device may use, where that number comes from) for this machine's first device."""
    if mesh_cfg.device_memory_limit_gb > 0:
        return mesh_cfg.device_memory_limit_gb * 2**30, "config.mesh.device_memory_limit_gb"
    device = jax.local_devices()[0]
    stats = device.memory_stats() or {}
    if "bytes_limit" in stats:
        return stats["bytes_limit"], "the device's memory"
    if device.platform == "cpu":
        # XLA:CPU reports no limit: the host's RAM shared by its CPU devices (an allocation beyond it fails
        # deep inside the runtime, after the step has started)
        return (
            os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / max(1, jax.local_device_count()),
            "this host's memory per CPU device",
        )
    return None, ""


def too_big_for_here(cfg, devices: int) -> str | None:
    """Why the train step cannot fit this machine's `devices` devices by the analytic estimate
    (perf.estimate_train_memory, with a flash kernel: the lower bound), or None. Said before the attention probe and
    the compile, with what the config is sized for and what would fit here; a step the estimate lets through still
    meets the compiled step's precheck."""
    limit, source = device_memory_limit(cfg.mesh)
    cfg = RunConfig.of(cfg)
    if cfg.model.dtype == "auto":  # resolved later (build); bf16, the smaller choice, keeps this a lower bound
        cfg = cfg.with_resolved(model=cfg.model.replace(dtype="bfloat16"))
    est = perf.estimate_train_memory(cfg, devices)
    if not limit or est["total"] <= limit:
        return None
    gib = lambda b: f"{b / 2**30:.1f} GiB" if b >= 2**30 else f"{b / 2**20:.2f} MiB"
    t = cfg.train
    target = re.match(r"\s*(\d+)\s*x\s*(H100|H200|A100)", cfg.mesh.target or "", re.I)
    check = (
        f"check it for that hardware with resformer compile --config=(the same file) "
        f"--target={target.group(2).lower()}x{target.group(1)}"
        if target
        else ""
    )
    fits = None
    fsdp_now = perf.fsdp_devices(cfg, devices)
    for remat, fsdp in dict.fromkeys(((cfg.model.remat, fsdp_now), ("full", fsdp_now), ("full", devices))):
        per_device = sequences_per_device(cfg, devices)
        while per_device >= 1 and fits is None:
            microbatch = per_device * devices
            trial = None
            if t.global_batch % microbatch == 0:
                trial = cfg.replace(
                    model=cfg.model.replace(remat=remat),
                    train=dataclasses.replace(cfg.train, microbatch=microbatch),
                    mesh=dataclasses.replace(cfg.mesh, fsdp=fsdp),
                )
            if trial is not None and perf.estimate_train_memory(trial, devices)["total"] <= limit:
                fits = (
                    f"--config.train.microbatch={microbatch}"
                    + (f" --config.model.remat={remat}" if remat != cfg.model.remat else "")
                    + (f" --config.mesh.fsdp={fsdp} --config.mesh.data=1" if fsdp != fsdp_now else "")
                )
            per_device //= 2
    here = (
        f"to run it here, {fits} fits by the estimate (or lower config.train.global_batch)"
        if fits
        else memory_knobs(cfg, devices) + f" (parameters and optimizer state alone: {gib(est['state'])} a device)"
    )
    sized = (f"this config is sized for {cfg.mesh.target}" + (f": {check}" if check else "")) if cfg.mesh.target else ""
    if fits:  # what fits may still not finish: say how long a step would take here
        floor, how = perf.step_time_floor(cfg)
        if floor > 3600:
            here += f", but one step would take at least {perf.say_hours(floor)} on this machine ({how})"
    return (
        f"the train step needs about {gib(est['total'])} per device by the analytic estimate (state "
        f"{gib(est['state'])}, activations {gib(est['activations_kept'] + est['one_layer'])}, attention "
        f"{gib(est['attention'])}, logits {gib(est['logits'])}, "
        f"{est['per_device_micro_batch']} sequences of {cfg.data.seq_len} tokens a device at once) but {source} "
        f"is {gib(limit)}; " + "; ".join(x for x in (sized, here) if x)
    )


def memory_line(mem: perf.StepMemory, limit: float | None) -> str:
    gib = lambda b: f"{b / 2**30:.3f} GiB"
    return (
        f"per-device memory: arguments {gib(mem.arguments)}, outputs {gib(mem.outputs)}, aliased "
        f"{gib(mem.aliased)}, temporaries {gib(mem.temporaries)}, total {gib(mem.total)}"
        + (f" of {gib(limit)}" if limit else "")
    )


def memory_precheck(
    mem: perf.StepMemory | None,
    mesh_cfg,
    *,
    limit: float | None = None,
    source: str = "",
    what: str = "the train step",
    knobs: str = "",
) -> tuple[str, float | None]:
    """(a line describing the step's memory per device, the limit); raises where it cannot fit, naming `knobs`
    (memory_knobs' advice).
    `limit`/`source`: another device's memory (a compile target's); default: this machine's first device."""
    if mem is None:
        return "per-device memory: not reported by this backend", None
    if limit is None:
        limit, source = device_memory_limit(mesh_cfg)
    if limit and mem.total > limit:
        raise MemoryPrecheckError(
            f"{what} needs {mem.total / 2**30:.3f} GiB per device but {source} is {limit / 2**30:.3f} GiB "
            f"(arguments {mem.arguments / 2**30:.3f} GiB, temporaries {mem.temporaries / 2**30:.3f} GiB)"
            + (f"; {knobs}" if knobs else "")
        )
    return memory_line(mem, limit), limit
