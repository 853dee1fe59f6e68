"""Mesh construction, logical-axis rules, and multi-host initialisation."""

from __future__ import annotations

import logging
import os
from typing import Any

import flax.linen as nn
import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from resformer_jax.errors import UserError

log = logging.getLogger(__name__)


class MeshError(UserError, ValueError):
    """A mesh or sharding that cannot work; the message names the field and the fix."""


def maybe_initialize_distributed(
    coordinator_address=None,
    num_processes=None,
    process_id=None,
    heartbeat_timeout_s: int = 100,
    initialization_timeout_s: int = 300,
):
    """jax.distributed.initialize(): from flags, or auto-detected on TPU pods and under SLURM, with the
    coordination service's timeouts (config.distributed: how long a dead peer goes unnoticed, how long start-up
    waits for every process)."""
    if jax.distributed.is_initialized() if hasattr(jax.distributed, "is_initialized") else False:
        return
    timeouts: dict[str, Any] = {
        "heartbeat_timeout_seconds": int(heartbeat_timeout_s),
        "initialization_timeout": int(initialization_timeout_s),
    }
    if coordinator_address:
        jax.distributed.initialize(
            coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id, **timeouts
        )
    elif "SLURM_JOB_ID" in os.environ and int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        jax.distributed.initialize(**timeouts)  # JAX reads SLURM's environment
    elif os.environ.get("TPU_WORKER_HOSTNAMES") or os.environ.get("MEGASCALE_COORDINATOR_ADDRESS"):
        jax.distributed.initialize(**timeouts)  # TPU pod: auto-detected


def make_mesh(mesh_cfg, devices=None) -> Mesh:
    """A (data, fsdp, context) mesh; one of data and fsdp may be -1 (fill with the remaining devices)."""
    devices = list(devices if devices is not None else jax.devices())
    if getattr(mesh_cfg, "num_devices", 0):
        if mesh_cfg.num_devices > len(devices):
            raise MeshError(f"config.mesh.num_devices={mesh_cfg.num_devices} but only {len(devices)} devices exist")
        devices = devices[: mesh_cfg.num_devices]
    context = int(getattr(mesh_cfg, "context", 1) or 1)  # older runs' configs have no context axis
    if len(devices) % context:
        raise MeshError(
            f"config.mesh.context={context} does not divide the {len(devices)} devices; choose a divisor of "
            f"{len(devices)}"
        )
    n = len(devices) // context  # what data x fsdp share
    data, fsdp = int(mesh_cfg.data), int(mesh_cfg.fsdp)
    if data == -1 and fsdp == -1:
        raise MeshError("config.mesh.data and config.mesh.fsdp are both -1; set at most one to -1")
    if data == -1:
        if n % fsdp:
            raise MeshError(f"config.mesh.fsdp={fsdp} does not divide the {n} devices; choose a divisor of {n}")
        data = n // fsdp
    if fsdp == -1:
        if n % data:
            raise MeshError(f"config.mesh.data={data} does not divide the {n} devices; choose a divisor of {n}")
        fsdp = n // data
    if data * fsdp != n:
        raise MeshError(
            f"mesh data={data} x fsdp={fsdp} x context={context} = {data * fsdp * context} but {n * context} "
            "devices are present; set one of config.mesh.data / config.mesh.fsdp to -1"
        )
    # context innermost: a sequence's slices on neighbouring devices (the same host, the fastest links)
    return Mesh(np.asarray(devices).reshape(data, fsdp, context), ("data", "fsdp", "context"))


def rules(mesh_cfg):
    return tuple((name, tuple(ax) if isinstance(ax, (list, tuple)) else ax) for name, ax in mesh_cfg.rules)


def logical_shardings(boxed_tree, mesh: Mesh, mesh_cfg):
    """NamedShardings for a tree of nn.Partitioned (logically annotated) values. optax's MaskedNode (the
    parameters another optimizer group updates, e.g. under Muon) stays a MaskedNode: it holds no array."""
    boxed_tree = jax.tree.map(  # a box around a MaskedNode (optax masks inside the boxes) is a MaskedNode
        lambda x: x.value if isinstance(x, nn.Partitioned) and isinstance(x.value, optax.MaskedNode) else x,
        boxed_tree,
        is_leaf=lambda x: isinstance(x, nn.Partitioned),
    )
    specs = nn.get_partition_spec(boxed_tree)
    table = rules(mesh_cfg)
    return jax.tree.map(
        lambda s: s if isinstance(s, optax.MaskedNode) else nn.logical_to_mesh_sharding(s, mesh, table),
        specs,
        is_leaf=lambda x: isinstance(x, (P, optax.MaskedNode)),
    )


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    return NamedSharding(mesh, P(("data", "fsdp"), *([None] * (ndim - 1))))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def check_divisibility(cfg, mesh: Mesh):
    """Batch, heads and vocab must divide over the axes they are sharded on."""
    n_batch = mesh.shape["data"] * mesh.shape["fsdp"]
    gb, mb = cfg.train.global_batch, cfg.train.microbatch or cfg.train.global_batch
    if gb % n_batch:
        raise MeshError(
            f"config.train.global_batch={gb} does not divide over {n_batch} devices (data x fsdp); "
            f"use a multiple of {n_batch}"
        )
    if mb % n_batch:
        raise MeshError(
            f"config.train.microbatch={mb} does not divide over {n_batch} devices (data x fsdp); "
            f"use a multiple of {n_batch}"
        )
    r = dict(rules(cfg.mesh))
    m = cfg.model
    for logical, size, field in (
        ("embed", m.d_model, "model.d_model"),
        ("vocab", m.vocab_size, "model.vocab_size"),
        ("q_heads", m.num_heads, "model.num_heads"),
        ("mlp", m.ffn_dim, "model.ffn_dim"),
        ("kv_heads", m.num_kv_heads or m.num_heads, "model.num_kv_heads"),
    ):
        axes = r.get(logical)
        if axes is None:
            continue
        axes = axes if isinstance(axes, tuple) else (axes,)
        k = int(np.prod([mesh.shape[a] for a in axes]))
        if size % k:
            raise MeshError(
                f"config.{field}={size} does not divide over mesh axes {axes} of size {k} "
                f"(rule {logical!r} -> {axes}); change the size or the rule in config.mesh.rules"
            )
