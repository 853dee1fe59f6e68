"""The training loop: the one state builder (train/setup.py) plus what only training needs: data,
checkpoints, logs, evaluation and the loop itself. The command (commands/main.py) makes the RunDir and
turns errors into one line."""

from __future__ import annotations

import json
import signal
import sys
import time

import jax
import numpy as np
from jax.experimental import multihost_utils

from resformer_jax import metrics, perf
from resformer_jax.checkpoint import CheckpointError, config_diff, params_layout
from resformer_jax.config import RUNTIME_MODEL_FIELDS, run_record, validate, with_defaults
from resformer_jax.data.pipeline import train_iterator, validation_sets
from resformer_jax.data.records import DataError, check_compatible, open_corpus
from resformer_jax.errors import UserError
from resformer_jax.model.lambdas import read_lambdas
from resformer_jax.parallel.mesh import maybe_initialize_distributed
from resformer_jax.rundir import RunDir
from resformer_jax.train.optimizer import lr_schedule
from resformer_jax.train.setup import MemoryPrecheckError, build, memory_knobs, memory_precheck, too_big_for_here


class NonFiniteError(UserError, RuntimeError):
    """The loss or a gradient became non-finite; the message names the step and the fix. Exit code 3: the run
    itself diverged (its input may be fine)."""

    exit_code = 3


def _get(d: dict, dotted: str):
    for part in dotted.split("."):
        d = d.get(part, {}) if isinstance(d, dict) else {}
    return d


class Trainer:
    def __init__(self, cfg, run: RunDir | str, coordinator_address=None, num_processes=None, process_id=None):
        maybe_initialize_distributed(
            coordinator_address,
            num_processes,
            process_id,
            cfg.distributed.heartbeat_timeout_s,
            cfg.distributed.initialization_timeout_s,
        )
        self.run = run if isinstance(run, RunDir) else RunDir(run)
        self.workdir = self.run.workdir
        self.is_main = jax.process_index() == 0
        self.progress = metrics.Progress(cfg.train.steps, enabled=self.is_main)
        self.say = self.progress.message
        self.asked = cfg  # what the user asked, never changed; self.cfg becomes the run's resolved copy at build
        self.cfg = cfg
        self.preempt = False

    # ------------------------------------------------------------------ setup
    def _check_data(self):
        """The data path and its shape against the config (seq_len, vocabulary), before anything costly."""
        cfg = self.cfg
        self.corpus = open_corpus(cfg.data)
        if self.corpus is not None:
            check_compatible(self.corpus.meta, cfg.data.seq_len, cfg.model.vocab_size, "", self.corpus.path)

    def _check_workdir_model(self):
        """The run directory's model against this config, every differing field in one line, before the probe and
        the compile (a resumed run cannot change the model)."""
        if not self.run.checkpoints.is_dir():
            return
        ck = self.run.checkpointer(read_only=True)
        try:
            newest = ck.newest_config()
        finally:
            ck.mngr.close()
        if newest is not None:
            self._check_resumed_config(newest[1], quiet=True)

    def _check_fits_here(self, error: UserError | None = None):
        """The analytic memory estimate at the run's shape against this machine's devices: a config sized for other
        hardware (the paper presets: 8x H100) stops here, saying what it is sized for and what would fit, before
        the attention probe or the compile (the compiled step's own precheck follows). `error`: an earlier check's
        problem (no data path), said in the same line."""
        why = too_big_for_here(self.cfg, jax.device_count())
        if why and error is not None:
            raise type(error)(f"{error}; and {why}") from None
        if why:
            raise MemoryPrecheckError(why)
        if error is not None:
            raise error

    def _data(self):
        cfg = self.cfg
        self.iter = train_iterator(cfg, jax.process_index(), jax.process_count())
        self.eval_sets = validation_sets(
            cfg, self.setup.eval_batch_shape[0], cfg.train.eval_batches, jax.process_index(), jax.process_count()
        )

    def _state(self):
        self.ckpt = self.run.checkpointer(self.cfg.checkpoint)
        # The run's parameter tree before touching its state: a shape change is the user's mistake, not a damaged
        # checkpoint, and must not set good checkpoints aside (the config's fields were compared at start).
        newest = self.ckpt.newest_config()
        if newest is not None:
            self._check_params_fit(*newest)
        restored = self.ckpt.restore_latest(self.setup.abstract_state, self.iter, warn=self._warn)
        if restored is None:
            history = self.ckpt.history()
            if history and not self.cfg.checkpoint.allow_fresh_start:
                raise CheckpointError(
                    f"{self.workdir} once held checkpoints ({'; '.join(history)}) but none is there to resume "
                    "from; refusing to start again from step 0. Move the checkpoints back to retry, or pass "
                    "--config.checkpoint.allow_fresh_start=True to start over (or use a new --workdir)"
                )
            self.state = self.setup.init_state()
            self.start_step = 0
            self.say(f"starting a new run in {self.workdir}")
        else:
            step, self.state, old_cfg, self.restored_progress = restored
            self._check_resumed_config(old_cfg)
            self.start_step = step
            self.say(f"resumed from step {step} ({self.ckpt.dir}/{step})")

    def _check_resumed_config(self, old: dict, quiet: bool = False):
        new = self.cfg.to_dict()
        diff = config_diff(with_defaults(old), new)  # a field added since the run started is not a change
        model = {f: ab for f, ab in diff.items() if f.startswith("model.") and f not in RUNTIME_MODEL_FIELDS}
        if model:
            raise CheckpointError(
                f"the run in {self.workdir} was started with another model ("
                + ", ".join(f"config.{f} is {b!r}, the run's {a!r}" for f, (a, b) in model.items())
                + "); a resumed run cannot change the model. Use "
                + " ".join(f"--config.{f}={a!r}" for f, (a, _) in model.items())
                + " or a new --workdir"
            )
        if self.corpus is not None:
            self.corpus.check_tokenizer(_get(with_defaults(old), "data.tokenizer_hash"))
        for field, (a, b) in ({} if quiet else diff).items():
            if field != "data.tokenizer_hash":
                self.say(f"note: config.{field} changed on resume: {a!r} -> {b!r}")

    def _check_params_fit(self, step: int, old: dict):
        """The checkpoint's parameter tree against the one this config builds: a difference is a changed
        config, not damage, so nothing is moved (derived from the trees, not a list of fields)."""
        saved = self.ckpt.saved_params_layout(step)
        if saved is None:
            return
        want = params_layout(self.setup.abstract_state.params)
        if saved == want:
            return
        only_saved, only_new = sorted(set(saved) - set(want)), sorted(set(want) - set(saved))
        reshaped = sorted(p for p in set(saved) & set(want) if saved[p] != want[p])
        parts = (
            ([f"only in the checkpoint: {only_saved[:3]}"] if only_saved else [])
            + ([f"only in this config: {only_new[:3]}"] if only_new else [])
            + [f"{p}: {saved[p]} saved, {want[p]} now" for p in reshaped[:3]]
        )
        fields = list(config_diff(old.get("model", {}), self.cfg.model.to_dict()))
        raise CheckpointError(
            f"the checkpoint at step {step} in {self.workdir} holds other parameters than this config builds "
            f"({'; '.join(parts)}); "
            + (f"changed model fields: {', '.join('config.model.' + f for f in fields)}; " if fields else "")
            + "use the run's original config or a new --workdir (nothing was moved)"
        )

    def _warn(self, msg):
        print(msg, file=sys.stderr, flush=True)

    def _compile(self):
        self.compiled, self.compile_s, mem = self.setup.compile()
        line, _ = memory_precheck(mem, self.cfg.mesh, knobs=memory_knobs(self.cfg, self.setup.mesh.devices.size))
        self.say(f"compiled train step in {self.compile_s:.1f}s; {line}")
        self.global_shape = self.setup.global_batch_shape
        self.batch_sh = self.setup.batch_sh
        self.eval_fn = self.setup.eval_step

    # ------------------------------------------------------------------ loop
    def _install_signals(self):
        def handler(signum, frame):
            self.preempt = True

        self._old_handlers = {signal.SIGINT: signal.signal(signal.SIGINT, handler)}
        if jax.process_count() == 1:  # multi-host: JAX's preemption notifier handles SIGTERM
            self._old_handlers[signal.SIGTERM] = signal.signal(signal.SIGTERM, handler)

    def _restore_signals(self):
        for sig, h in getattr(self, "_old_handlers", {}).items():
            signal.signal(sig, h)

    def _should_stop(self, step: int) -> bool:
        flag = self.preempt
        if jax.process_count() > 1:
            flag = bool(np.any(multihost_utils.process_allgather(np.int32(flag))))
            flag = flag or self.ckpt.reached_preemption(step)
        return flag

    def _save(self, step: int, force: bool = True):
        first_bad = int(jax.device_get(self.state.first_nonfinite_step))
        if first_bad >= 0 and not self.cfg.train.skip_nonfinite_steps:
            raise self._nonfinite(first_bad)
        progress = {
            "step": step,
            "tokens": step * self.global_shape[0] * self.cfg.data.seq_len,
            "elapsed_s": self.elapsed + time.perf_counter() - self.t_start,
        }
        self.ckpt.save(step, self.state, self.iter, run_record(self.asked.to_dict(), self.cfg), progress, force=force)

    def _nonfinite(self, step: int):
        last = [s for s in self.ckpt.all_steps() if s <= step]
        kept = f"the last good checkpoint (step {last[-1]}) is intact" if last else "no checkpoint was written"
        return NonFiniteError(
            f"the loss or gradient became non-finite at step {step}; training stopped and {kept}. Lower "
            "config.train.peak_lr or raise warmup_steps, or set --config.train.skip_nonfinite_steps=True to skip "
            "such steps"
        )

    def _evaluate(self, step: int) -> dict:
        out = {}
        for dom, batches in self.eval_sets.items():
            losses = [self.eval_fn(self.state.params, self._global(b)) for b in batches]
            out[f"eval/{dom}/loss"] = float(np.mean(jax.device_get(losses)))
        out["eval/loss"] = float(np.mean(list(out.values())))
        return out

    def _global(self, local):
        shape = (local.shape[0] * jax.process_count(),) + local.shape[1:]
        return jax.make_array_from_process_local_data(self.batch_sh, local, shape)

    def _lambdas(self) -> dict:
        return {
            f"lambdas/layer_{n:02d}/{name}": v
            for n, d in read_lambdas(self.state.params, self.cfg.model).items()
            for name, v in d.items()
        }

    def train(self) -> int:
        self._install_signals()  # first: a SIGTERM during start-up also ends in a clean save-and-exit
        try:
            return self._train()
        finally:
            self._restore_signals()

    def _train(self) -> int:
        self._start()
        end = self._end_step()
        step, exit_code = self.start_step, 0
        pending = []  # step metrics, pulled to the host only at log intervals (after the next dispatch)
        while step < end:
            batch = self._global(next(self.iter))
            self.state, m = self.compiled(self.state, batch)
            step += 1
            pending.append(m)
            if step % self.cfg.train.log_every == 0 or step == self.cfg.train.steps:
                self._log(step, pending)
                pending = []
            if self.eval_sets and (step % self.cfg.train.eval_every == 0 or step == self.cfg.train.steps):
                self._log_evaluation(step)
            if self._should_stop(step):
                self._save(step)
                self.ckpt.wait()
                self.say(f"preempted: saved a checkpoint at step {step}; rerun the same command to resume")
                break
            if step % self.cfg.checkpoint.every_steps == 0 and step < end:
                self._save(step)
        else:
            if step > self.start_step and step not in self.ckpt.all_steps():
                self._save(step)
        self._finish(step)
        return exit_code

    # ------------------------------------------------------------------ the loop's named steps
    def _start(self):
        """The compiled step (and the memory precheck), data, the state (resumed or new), the run's files, the
        first evaluation."""
        cfg = self.cfg
        # Cheap checks first, each before anything that takes seconds: the config, the data, the run directory's
        # model, the memory the config needs; then the builder's attention probe (at the microbatch) and the compile.
        validate(cfg)
        try:
            self._check_data()
        except DataError as e:
            self._check_fits_here(error=e)  # a config that cannot fit here says so in the same line
        self._check_workdir_model()
        self._check_fits_here()
        # The one builder: validation, dtype, mesh, divisibility, attention, model, optimizer, shardings, steps.
        self.setup = build(cfg, log=self.say)
        self.cfg = cfg = self.setup.cfg  # the run as it runs: model.dtype resolved (data.tokenizer_hash below)
        self.mesh, self.state_sh = self.setup.mesh, self.setup.state_sh
        # Compiled first: a step that cannot fit stops here, before the state is allocated, the validation
        # batches are cut or anything is written in the workdir.
        self._compile()
        self._data()
        self._state()
        if self.is_main and self.corpus is not None:
            self.corpus.copy_tokenizer(self.run.tokenizer_json)
        if self.corpus is not None:
            cfg.data.tokenizer_hash = self.corpus.tokenizer_sha256
        if self.is_main:
            self.run.path.mkdir(parents=True, exist_ok=True)
            # The run's resolved config, readable without the checkpoint library (compare groups runs by it).
            self.run.write_config(json.dumps(run_record(self.asked.to_dict(), cfg), indent=1, default=list))
        self.writer = metrics.Writer(self.run.tensorboard, enabled=self.is_main, jsonl=self.run.metrics_jsonl)
        if self.setup.attention.probed:
            self.writer.text(
                "attention_impl",
                f"auto chose **{self.setup.attention.impl}**; rejected: {json.dumps(self.setup.attention.rejected)}",
            )
        self.flops = perf.model_flops(cfg.model, cfg.data.seq_len)
        self.peak, peak_src = perf.device_peak_flops(cfg.model.dtype)
        self.tokens_per_step = cfg.train.global_batch * cfg.data.seq_len
        self.schedule = lr_schedule(cfg.train)
        self.writer.text("config", "```\n" + cfg.to_json_best_effort(indent=2) + "\n```")
        self.say(
            f"model: {self.flops.params_total:,} params ({self.flops.params_non_embedding:,} non-embedding), "
            f"{cfg.model.value_residual}; {self.flops.per_token / 1e9:.3f} GFLOP/token; {jax.device_count()} "
            f"devices, mesh {dict(self.mesh.shape)}; peak {self.peak / 1e12:.3f} TFLOP/s ({peak_src})"
        )
        self.say(f"logs: tensorboard --logdir {self.run.path}")
        self.elapsed = getattr(self, "restored_progress", {}).get("elapsed_s", 0.0)
        self.t_start = self.t_last = time.perf_counter()
        self.last_logged = self.start_step
        self.first_eval = self.last_eval = None
        if self.start_step == 0 and self.eval_sets:
            self.first_eval = self.last_eval = self._evaluate(0)
            self.writer.scalars(0, self.first_eval)
            self.say(f"step {0:>7}  validation loss {self.first_eval['eval/loss']:.4f}")

    def _end_step(self) -> int:
        """Where this invocation stops: train.steps, or train.stop_at before it (0 steps when preempted during
        start-up or already there, saying so)."""
        cfg = self.cfg
        end = min(cfg.train.stop_at or cfg.train.steps, cfg.train.steps)
        if self.start_step >= end:
            which = (
                f"config.train.stop_at={cfg.train.stop_at}"
                if cfg.train.stop_at and end < cfg.train.steps
                else f"config.train.steps={cfg.train.steps}"
            )
            self.say(
                f"nothing to do: the run in {self.workdir} is at step {self.start_step}, and {which}; raise "
                "--config.train.steps to train further"
            )
        if self.preempt and self.start_step < end:
            self.say(
                "stopped during start-up (SIGTERM/SIGINT) before any step; nothing new to save. "
                "Rerun the same command to continue"
            )
            end = self.start_step
        return end

    def _log(self, step: int, pending: list):
        """The steps since the last log, averaged: loss, learning rate, grad norm, throughput, MFU, lambdas."""
        cfg = self.cfg
        host = jax.device_get(pending)
        now = time.perf_counter()
        step_time = (now - self.t_last) / max(step - self.last_logged, 1)
        self.t_last, self.last_logged = now, step
        losses = [h["loss"] for h in host]
        bad = sum(int(h["nonfinite"]) for h in host)
        if bad and not cfg.train.skip_nonfinite_steps:
            raise self._nonfinite(int(jax.device_get(self.state.first_nonfinite_step)))
        finite = [x for x in losses if np.isfinite(x)]
        loss = float(np.mean(finite)) if finite else float("nan")
        tps = self.tokens_per_step / step_time
        vals = {
            "train/loss": loss,
            "train/learning_rate": float(self.schedule(step - 1)),
            "train/grad_norm": float(np.mean([h["grad_norm"] for h in host])),
            "perf/tokens_per_s": tps,
            "perf/step_time_s": step_time,
            **{f"perf/{k}": v for k, v in perf.mfu(self.flops, tps, self.peak).items()},
            "train/nonfinite_steps": float(jax.device_get(self.state.nonfinite_count)),
        }
        vals.update(self._lambdas())
        self.writer.scalars(step, vals)
        self.progress.update(
            step,
            loss,
            tps,
            step_time,
            f"  MFU {vals['perf/mfu_6n']:.2f} (6N) {vals['perf/mfu_model']:.2f} (model)"
            if np.isfinite(self.peak)
            else "",
        )

    def _log_evaluation(self, step: int):
        self.last_eval = self._evaluate(step)
        self.writer.scalars(step, self.last_eval)
        self.say(
            f"step {step:>7}  validation loss {self.last_eval['eval/loss']:.4f}  "
            + "  ".join(f"{k.split('/')[1]} {v:.3f}" for k, v in self.last_eval.items() if k.count("/") == 2)
        )

    def _finish(self, step: int):
        self.ckpt.close()
        self.writer.flush()
        self.writer.close()
        if self.is_main and self.first_eval and self.last_eval and step == self.cfg.train.steps:
            self.say(
                f"done: validation loss {self.first_eval['eval/loss']:.4f} -> {self.last_eval['eval/loss']:.4f}. "
                f"TensorBoard: tensorboard --logdir {self.run.path}"
            )
        elif self.is_main and step == self.cfg.train.steps:
            self.say(f"done. TensorBoard: tensorboard --logdir {self.run.path}")
