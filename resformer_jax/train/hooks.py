"""What the loop does after a step besides stepping: logging and evaluation, wired as hooks (as Levanter's trainer
wires them). A hook is when it is due, the watchdog phase it runs in and a function of (session, step);
`Trainer._train` calls the due ones, in order, after each step. The functions here read the session and write its
metrics; what the Trainer alone owns (the console, the watchdog, the goodput ledger) reaches them as arguments."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any

import jax
import numpy as np

from resformer_jax import perf
from resformer_jax.eval.zero_shot import zero_shot
from resformer_jax.model.lambdas import gate_intermediates, gate_means, read_lambdas
from resformer_jax.train import telemetry


@dataclasses.dataclass(frozen=True)
class Hook:
    """`run(session, step)` after every `every`-th step and after the last one, in the watchdog phase `phase`
    ("step": the step's own, no switch)."""

    name: str
    every: int
    phase: str
    run: Callable[[Any, int], None]

    def due(self, step: int, last: int) -> bool:
        return step % self.every == 0 or step == last


def global_batch(s, local):
    """A process's rows of a batch as the global array the steps take."""
    shape = (local.shape[0] * jax.process_count(),) + local.shape[1:]
    return jax.make_array_from_process_local_data(s.setup.batch_sh, local, shape)


class Interrupted(Exception):
    """A hook stopped between its batches because the run was asked to stop (SIGTERM/SIGINT): the checkpoint
    comes first."""


def evaluate(s, stop: Callable[[], bool] = lambda: False) -> dict:
    """Validation loss per domain and its mean; with a tokenizer also bits per byte per domain and overall
    (nats over the UTF-8 bytes of the text the target tokens stand for, / ln 2). `stop()` is asked between
    batches (one batch in flight at most): true raises Interrupted."""
    out, nats, nbytes = {}, 0.0, 0
    for dom, batches in s.eval_sets.items():
        losses: list = []  # (mean, targets counted) a batch: the domain's loss is over every target counted
        for b in batches:
            if losses:
                jax.block_until_ready(losses[-1])  # one batch in flight: a stop waits for one batch, not a domain
            if stop():
                raise Interrupted(dom)
            losses.append(s.setup.eval_step(s.state.params, global_batch(s, b)))
        means, counts = np.asarray(jax.device_get(losses), np.float64).T
        out[f"eval/{dom}/loss"] = float(np.sum(means * counts) / max(np.sum(counts), 1))
    out["eval/loss"] = float(np.mean([v for k, v in out.items()]))
    if s.setup.model_cfg.gates_values and s.eval_sets:  # the learned gates per layer, on a validation batch
        batch = global_batch(s, next(iter(s.eval_sets.values()))[0])
        if s.gate_forward is None:  # compiled once
            s.gate_forward = jax.jit(lambda p, t: gate_intermediates(s.setup.model, p, t[:, :-1]))
        gates = gate_means(s.gate_forward(s.state.params, batch))
        out.update({f"gates/layer_{n:02d}/value_gate": g for n, g in gates.items()})
    for dom, (tokens, text_bytes) in (s.eval_bytes or {}).items():
        dom_nats = out[f"eval/{dom}/loss"] * tokens
        out[f"eval/{dom}/bpb"] = dom_nats / (math.log(2) * max(text_bytes, 1))
        nats, nbytes = nats + dom_nats, nbytes + text_bytes
    if nbytes:
        out["eval/bpb"] = nats / (math.log(2) * nbytes)
    return out


def log_validation(s, step: int, say: Callable[[str], Any], stop: Callable[[], bool] = lambda: False) -> None:
    """The validation sets evaluated, to TensorBoard and one console line."""
    s.last_eval = evaluate(s, stop)
    s.writer.scalars(step, s.last_eval)
    say(
        f"step {step:>7}  validation loss {s.last_eval['eval/loss']:.4f}  "
        + "  ".join(
            f"{k.split('/')[1]} {v:.3f}" for k, v in s.last_eval.items() if k.count("/") == 2 and k.endswith("/loss")
        )
        + (f"  bits/byte {s.last_eval['eval/bpb']:.4f}" if "eval/bpb" in s.last_eval else "")
    )


def evaluate_tasks(s, step: int, workdir: str, say: Callable[[str], Any]) -> None:
    """The zero-shot tasks of `eval.tasks` on the live parameters, as `resformer evaluate` scores them."""
    e = s.cfg.eval
    tasks = [t for t in e.tasks.split(",") if t]
    # Every process scores the same items on the sharded parameters (the corpus's tokenizer: each host has the
    # data; the run directory's copy may be on process 0's disk only).
    tok = s.corpus.tokenizer() if s.corpus is not None else None
    mesh = s.setup.mesh if jax.process_count() > 1 else None
    found = zero_shot(
        s.cfg,  # its model as the run built it (resolve.Run: one model config)
        s.state.params,
        workdir,
        tasks,
        e.task_data,
        e.task_limit,
        log=lambda m: say(f"step {step:>7}  {m}"),
        tokenizer=tok,
        mesh=mesh,
    )
    s.writer.scalars(step, {f"tasks/{t}/{k}": r[k] for t, r in found.items() for k in ("acc", "acc_norm")})


def window_scalars(s, step: int, host: list[dict], step_time: float) -> dict:
    """The scalars of the steps since the last log (their metrics pulled to the host), averaged: loss, learning
    rate, grad norm, throughput, MFU, the per-layer telemetry, z-loss, skipped spikes, the learned lambdas."""
    finite = [h["loss"] for h in host if np.isfinite(h["loss"])]
    tps = s.tokens_per_step / step_time
    kept = float(np.mean([h["attended_fraction"] for h in host])) if "attended_fraction" in host[0] else None
    flops = s.flops if kept is None else s.flops.attending(kept)  # packed documents: attention by the pairs kept
    vals = {
        "train/loss": float(np.mean(finite)) if finite else float("nan"),
        "train/learning_rate": float(s.schedule(step - 1)),
        "train/grad_norm": float(np.mean([h["grad_norm"] for h in host])),
        "perf/tokens_per_s": tps,
        "perf/step_time_s": step_time,
        **{f"perf/{k}": v for k, v in perf.mfu(flops, tps, s.peak).items()},
        "train/nonfinite_steps": float(jax.device_get(s.state.nonfinite_count)),
    }
    if "telemetry" in host[-1]:
        vals.update(telemetry.scalars(host[-1]["telemetry"]))
    if kept is not None:
        vals["perf/attended_fraction"] = kept
    if "z_loss" in host[0]:
        vals["train/z_loss"] = float(np.mean([h["z_loss"] for h in host]))
    if s.state.spikes is not None:
        vals["train/skipped_spikes"] = float(jax.device_get(s.state.spikes.skipped))
    vals.update(
        {
            f"lambdas/layer_{n:02d}/{name}": v
            for n, d in read_lambdas(s.state.params, s.cfg.model).items()
            for name, v in d.items()
        }
    )
    return vals
