"""One builder of the train state for every command that trains or compiles a step: the trainer, the benchmarks
and the compile command all come here.

Its notes (the reasons, what was measured): docs/modules.md.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from resformer_jax import perf
from resformer_jax.model import Transformer
from resformer_jax.model.config import ModelConfig
from resformer_jax.optimizer import make_optimizer
from resformer_jax.parallel.mesh import batch_sharding, check_divisibility, logical_shardings, make_mesh, replicated
from resformer_jax.resolve import AttentionChoice, Run
from resformer_jax.train.step import TrainState, init_state, make_eval_step, make_train_step


def spike_window(t) -> int:
    """The loss-spike window the train state holds (0: spike skipping off, nothing in the state)."""
    return int(t.spike_window) if t.spike_sigma > 0 else 0


def state_template(model, tx, seq_len: int, spikes: int = 0):
    """The boxed (logically partitioned) train state as shapes, without allocating it."""
    return jax.eval_shape(lambda r: init_state(model, tx, r, seq_len, spikes), jax.random.PRNGKey(0))


@dataclasses.dataclass
class TrainSetup:
    run: Run  # the run as it runs (resolve.resolve)
    mesh: jax.sharding.Mesh
    model: Transformer
    tx: Any
    state_sh: Any  # NamedShardings of the TrainState
    abstract_state: Any  # ShapeDtypeStructs with those shardings
    batch_sh: NamedSharding
    train_step: Any  # jitted (state, tokens [B, T+1]) -> (state, metrics)
    eval_step: Any  # jitted (params, tokens) -> (mean loss, targets counted)
    # train.telemetry: the same step with the per-layer norms in its metrics, run on logged steps only (a condition
    # inside one program kept every step's gradients and parameters live for it: a slower step)
    telemetry_step: Any = None

    @property
    def cfg(self):
        """The run's config as it runs (frozen)."""
        return self.run.cfg

    @property
    def model_cfg(self) -> ModelConfig:
        return self.run.model

    @property
    def attention(self) -> AttentionChoice:
        return self.run.attention

    @property
    def compiler_options(self) -> dict:
        """XLA options both steps compile with (runtime.cpu_step_compiler_options; usually none)."""
        return dict(self.run.compiler_options)

    @property
    def global_batch_shape(self) -> tuple[int, int]:
        return self.cfg.train.global_batch, self.cfg.data.seq_len + 1

    @property
    def eval_batch_shape(self) -> tuple[int, int]:
        """The evaluation batch: one microbatch (the whole batch without accumulation), so evaluating needs no
        more memory than a training microbatch."""
        return self.cfg.train.microbatch or self.cfg.train.global_batch, self.cfg.data.seq_len + 1

    def init_state(self, seed: int | None = None) -> TrainState:
        """A fresh state laid out on the mesh (parameters and optimizer state sharded)."""
        seed = self.cfg.train.seed if seed is None else seed
        spikes = spike_window(self.cfg.train)
        init = lambda r: nn.unbox(init_state(self.model, self.tx, r, self.cfg.data.seq_len, spikes))
        return jax.jit(init, out_shardings=self.state_sh)(jax.random.PRNGKey(seed))

    def compile(self, telemetry: bool = False):
        """(compiled train step, compile seconds, XLA's memory estimate per device); telemetry: the step with the
        per-layer norms (None when train.telemetry is off)."""
        step = self.telemetry_step if telemetry else self.train_step
        if step is None:
            return None, 0.0, None
        t0 = time.perf_counter()
        batch = jax.ShapeDtypeStruct(self.global_batch_shape, jnp.int32, sharding=self.batch_sh)
        compiled = step.lower(self.abstract_state, batch).compile()
        return compiled, time.perf_counter() - t0, perf.step_memory(compiled)


def build(run: Run, *, mesh=None, devices=None) -> TrainSetup:
    """Everything a command needs to train, benchmark or run the resolved `run` (resolve.resolve).

    `devices`: build for other hardware than this machine's (compilation/aot.py passes a TPU slice's or a GPU node's
    compile-only devices, having resolved the run for that platform); everything else is what a run on that
    hardware builds."""
    cfg = run.cfg
    mesh = mesh if mesh is not None else make_mesh(cfg.mesh, devices)
    check_divisibility(cfg, mesh)
    model, tx = Transformer(run.model, mesh=mesh), make_optimizer(cfg.train)
    boxed = state_template(model, tx, cfg.data.seq_len, spike_window(cfg.train))
    state_sh = logical_shardings(boxed, mesh, cfg.mesh)
    abstract = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), nn.unbox(boxed), state_sh)
    batch_sh = batch_sharding(mesh)
    t = cfg.train
    num_micro = t.global_batch // (t.microbatch or t.global_batch)
    micro_sh = NamedSharding(mesh, P(None, ("data", "fsdp"), None))
    rep = replicated(mesh)
    options = dict(run.compiler_options)
    document_starts = bool(cfg.data.document_start_loss)

    def jitted_step(telemetry: bool):
        return jax.jit(
            make_train_step(
                model,
                tx,
                num_micro,
                micro_sh,
                t.loss_chunk_len,
                dropout_seed=t.seed,
                z_loss=t.z_loss,
                spike_sigma=t.spike_sigma,
                telemetry=telemetry,
                document_starts=document_starts,
            ),
            in_shardings=(state_sh, batch_sh),
            out_shardings=(state_sh, rep),
            donate_argnums=(0,),
            compiler_options=options or None,
        )

    train_step = jitted_step(False)
    eval_step = jax.jit(
        make_eval_step(model, t.loss_chunk_len, document_starts),
        in_shardings=(state_sh.params, batch_sh),
        out_shardings=rep,
        compiler_options=options or None,
    )
    return TrainSetup(
        run,
        mesh,
        model,
        tx,
        state_sh,
        abstract,
        batch_sh,
        train_step,
        eval_step,
        jitted_step(True) if t.telemetry else None,
    )
