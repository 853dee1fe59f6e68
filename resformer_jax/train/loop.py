"""The training loop: the one state builder (train/setup.py) plus what only training needs: data,
checkpoints, logs, evaluation and the loop itself. The command (commands/main.py) makes the RunDir and
turns errors into one line."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from resformer_jax import metrics, perf
from resformer_jax.config import RunConfig
from resformer_jax.data.pipeline import train_iterator, validation_sets
from resformer_jax.data.records import DataError, check_compatible, open_corpus
from resformer_jax.errors import EXIT_DIVERGED, UserError
from resformer_jax.eval.zero_shot import check_tasks
from resformer_jax.memory import MemoryPrecheckError, memory_knobs, memory_precheck, too_big_for_here
from resformer_jax.optimizer import group_sizes, lr_schedule
from resformer_jax.parallel.mesh import maybe_initialize_distributed
from resformer_jax.resolve import check, resolve
from resformer_jax.rundir import RunDir
from resformer_jax.storage import is_remote
from resformer_jax.train import goodput
from resformer_jax.train.faults import Faults
from resformer_jax.train.hooks import (
    Hook,
    Interrupted,
    evaluate,
    evaluate_tasks,
    global_batch,
    log_validation,
    window_scalars,
)
from resformer_jax.train.interrupt import StartupInterrupt
from resformer_jax.train.resume import Resume
from resformer_jax.train.setup import TrainSetup, build
from resformer_jax.train.watchdog import PHASES, Budgets, Watchdog


class NonFiniteError(UserError, RuntimeError):
    """The loss or a gradient became non-finite; the message names the step and the fix. Exit code 3: the run
    itself diverged (its input may be fine)."""

    exit_code = EXIT_DIVERGED


@dataclasses.dataclass
class Session:
    """Everything a started run holds, made once by `Trainer._start` and passed to each step of the loop."""

    cfg: RunConfig  # the run as it runs: what was asked, typed, with the resolved values in place
    setup: TrainSetup  # mesh, model, shardings, jitted steps (train/setup.build)
    compiled: Any  # the compiled train step
    compiled_telemetry: Any  # the same with the per-layer norms, for logged steps (None: train.telemetry off)
    corpus: Any  # the prepared corpus (data/records.Corpus), or None for synthetic data
    data: Any  # the training batches' iterator (its position is checkpointed)
    eval_sets: dict  # {domain: validation batches}
    eval_bytes: dict | None  # {domain: (target tokens, their text's UTF-8 bytes)}: bits per byte (None: no tokenizer)
    ckpt: Any  # the run's Checkpointer
    state: Any  # the TrainState, updated every step
    start_step: int
    writer: metrics.Writer
    flops: perf.ModelFlops
    peak: float  # the devices' peak FLOP/s (MFU's denominator)
    schedule: Callable[[int], Any]  # step -> learning rate
    elapsed_before: float  # seconds trained before this invocation (the checkpoint's progress)
    t_start: float = 0.0
    t_last: float = 0.0
    last_logged: int = 0
    first_eval: dict | None = None
    last_eval: dict | None = None
    pending: list = dataclasses.field(default_factory=list)  # step metrics, pulled to the host at log steps
    hooks: list[Hook] = dataclasses.field(default_factory=list)  # after a step, when due: logging, evaluation
    gate_forward: Any = None  # resformer_lambdas=gated: the forward that reads the gates at evaluations

    @property
    def tokens_per_step(self) -> int:
        return self.cfg.train.global_batch * self.cfg.data.seq_len


class NothingToDo(Exception):
    """The run is already at its last step (train.steps, or train.stop_at before it): found before the compile."""

    def __init__(self, step: int):
        super().__init__(step)
        self.step = step

    def message(self, workdir: str, train) -> str:
        which = (
            f"config.train.stop_at={train.stop_at}"
            if train.stop_at and train.stop_at < train.steps
            else f"config.train.steps={train.steps}"
        )
        return (
            f"nothing to do: the run in {workdir} is at step {self.step}, and {which}; raise --config.train.steps "
            "to train further"
        )


class Trainer:
    def __init__(
        self,
        cfg,
        run: RunDir | str,
        coordinator_address=None,
        num_processes=None,
        process_id=None,
        step_bound: Callable[[Any, Any, int], str] | None = None,
    ):
        """`step_bound(compiled, cfg, devices)`: words on the compiled step's bound for the start-up line (the
        training command passes the roofline's; '' or None: none said)."""
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
        self.asked = cfg  # what the user asked, never changed (the run's resolved copy is the session's cfg)
        self.typed = check(cfg)  # the one validation of a start: every field that could make the run impossible
        self.preempt = False
        self.session: Session | None = None  # set by _start
        self._old_handlers: dict = {}
        # Where the time goes (written by process 0 once the run has started) and the watchdog over each phase.
        self.ledger = goodput.Ledger(self.run.goodput_json)
        self.watchdog = Watchdog(
            Budgets.of(self.typed.watchdog),
            self.run.watchdog_stacks(jax.process_index()),
            jax.process_index(),
            jax.process_count(),
        )
        self.watchdog.on_stall.append(self._record_stall)
        self.resume = Resume(self.run, self.say, self._warn, self._enter)
        self.faults = Faults.from_env(jax.process_index())  # tests' injected stalls and spikes; unset: nothing
        self.step_bound = step_bound

    def _enter(self, phase: str, step: int | None = None) -> None:
        """The loop enters `phase`: the watchdog's clock and budget, the ledger's category."""
        self.watchdog.enter(phase, step)
        self.ledger.switch(PHASES[phase].category)

    @contextlib.contextmanager
    def _phase(self, phase: str, step: int | None = None):
        """A phase inside the loop's steps (an evaluation, a save); back to "step" after it."""
        self._enter(phase, step)
        try:
            yield
        finally:
            self._enter("step", step)

    def _record_stall(self, phase: str, seconds: float) -> None:
        """The watchdog fired (its thread, the main one blocked): the stalled time goes into the ledger."""
        self.ledger.stalled(phase, seconds)
        self.ledger.write(end="stalled")

    # ------------------------------------------------------------------ the checks before anything costly
    def _check_data(self, cfg):
        """The data path and its shape against the config (seq_len, vocabulary); the corpus, or None."""
        corpus = open_corpus(cfg.data)
        if corpus is not None:
            check_compatible(corpus.meta, cfg.data.seq_len, cfg.model.vocab_size, "", corpus.path)
        return corpus

    def _check_fits_here(self, cfg, error: UserError | None = None):
        """The analytic memory estimate at the run's shape against this machine's devices: a config sized for other
        hardware (the paper presets: 8x H100) stops here, saying what it is sized for and what would fit, before
        the attention probe or the compile (the compiled step's own precheck follows). `error`: an earlier check's
        problem (no data path), said in the same line."""
        why = too_big_for_here(self.typed, jax.device_count())
        if why and error is not None:
            raise type(error)(f"{error}; and {why}") from None
        if why:
            raise MemoryPrecheckError(why)
        if error is not None:
            raise error

    def _check_step_time(self, cfg):
        """A step that takes more than an hour here is said in one line before the compile: the run will start,
        but a user on the wrong machine learns it now, not after the first step."""
        floor, how = perf.step_time_floor(self.typed)
        if floor > 3600:
            self._warn(
                f"warning: one step of this config takes at least {perf.say_hours(floor)} on this machine ({how}); "
                "for this machine take a smaller preset (configs/resformer_2m.py), inspect this one with "
                "--mode=summary, or check it for the hardware it is sized for with `resformer compile "
                "--config=(the same file) --target=h100x8`"
            )

    def _warn(self, msg):
        print(msg, file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ start
    def _eval_bytes(self, cfg, corpus, eval_sets) -> dict | None:
        """{domain: (target tokens, UTF-8 bytes of their text)} over every process's validation batches, for bits
        per byte; None without a tokenizer (synthetic data)."""
        table = corpus.bytes_per_token(cfg.model.vocab_size) if corpus is not None else None
        if table is None:
            return None
        out = {}
        for dom, batches in eval_sets.items():
            local = np.array([sum(b[:, 1:].size for b in batches), sum(int(table[b[:, 1:]].sum()) for b in batches)])
            if jax.process_count() > 1:
                local = np.asarray(multihost_utils.process_allgather(local)).sum(axis=0)
            out[dom] = (int(local[0]), int(local[1]))
        return out

    def _compile(self, setup: TrainSetup, cfg):
        self._enter("compile")
        self.say("compiling the train step (Ctrl-C stops at once) ...")
        compiled, compile_s, mem = setup.compile()
        devices = setup.mesh.devices.size
        line, _ = memory_precheck(mem, cfg.mesh, knobs=memory_knobs(cfg, devices))
        micro = cfg.train.microbatch or cfg.train.global_batch
        shards = max(1, devices // max(1, cfg.mesh.context))
        bound = self.step_bound(compiled, cfg, devices) if self.step_bound else ""
        self.say(
            f"compiled train step in {compile_s:.1f}s; mesh {dict(setup.mesh.shape)}, microbatch {micro} "
            f"({micro / shards:g} sequences a device, {cfg.train.global_batch // micro} microbatches a step), remat "
            f"{cfg.model.remat}; {line}" + (f"; {bound}" if bound else "")
        )
        with_norms, norms_s, norms_mem = setup.compile(telemetry=True)
        if with_norms is not None:
            memory_precheck(norms_mem, cfg.mesh, knobs=memory_knobs(cfg, setup.mesh.devices.size))
            self.say(f"compiled the logged steps' train step with per-layer telemetry in {norms_s:.1f}s")
        return compiled, with_norms

    def _start(self) -> Session:
        """The checks, the one builder, the compiled step (and the memory precheck), data, the state (resumed or
        new), the run's files, the first evaluation: the Session the loop runs on."""
        cfg = self.asked
        # Cheap checks first, each before anything that takes seconds: the config, the data, the run directory's
        # model, the fork, the memory the config needs; then the resolution (the dtype measured, the attention
        # probed at the microbatch) and the compile.
        done = self.resume.check_run_dir(cfg)  # the newest finished step if the run looks finished
        if cfg.eval.tasks:  # the task names and files, before anything costly
            check_tasks([t for t in cfg.eval.tasks.split(",") if t], cfg.eval.task_data)
        try:
            corpus = self._check_data(cfg)
        except DataError as e:
            self._check_fits_here(cfg, error=e)  # a config that cannot fit here says so in the same line
            raise
        self.resume.check_workdir_model(cfg, corpus)
        self.resume.check_fork(cfg, corpus)
        self._check_fits_here(cfg)
        self._check_step_time(cfg)
        # The run resolved once, then the one builder: mesh, model, optimizer, shardings, steps.
        run = resolve(
            cfg,
            run=self.run,
            tokenizer_hash=corpus.tokenizer_sha256 if corpus is not None else None,
            eot_id=corpus.eot_id if corpus is not None else None,
            log=self.say,
            typed=self.typed,
        )
        setup = build(run)
        cfg = run.cfg  # the run as it runs, frozen
        if done is not None and self.resume.restores(setup, done):
            raise NothingToDo(done)  # finished, its last checkpoint intact: no compile for nothing
        # Compiled first: a step that cannot fit stops here, before the state is allocated, the validation
        # batches are cut or anything is written in the workdir.
        compiled, compiled_telemetry = self._compile(setup, cfg)
        self._enter("start-up")
        data = train_iterator(cfg, jax.process_index(), jax.process_count())
        eval_sets = validation_sets(
            cfg, setup.eval_batch_shape[0], cfg.train.eval_batches, jax.process_index(), jax.process_count()
        )
        eval_bytes = self._eval_bytes(cfg, corpus, eval_sets)
        ckpt = self.run.checkpointer(cfg.checkpoint)
        state, start_step, progress = self.resume.restore(cfg, setup, ckpt, data, corpus)
        self._enter("start-up")
        if self.is_main and corpus is not None:
            corpus.copy_tokenizer(self.run.tokenizer_json)
        if self.is_main:
            self.run.path.mkdir(parents=True, exist_ok=True)
            # What was asked and what was resolved, readable without the checkpoint library (compare reads it).
            self.run.write_config(json.dumps(run.record(), indent=1, default=list))
        sink = None
        if cfg.train.wandb_project and self.is_main:
            local = self.run.path if not is_remote(self.run.path) else tempfile.mkdtemp(prefix="resformer_wandb_")
            sink = metrics.WandbSink(
                cfg.train.wandb_project,
                self.run.path / "wandb_run_id",
                os.fspath(local),
                run.record(),
                name=self.run.path.name,
            )
        writer = metrics.Writer(self.run.tensorboard, enabled=self.is_main, jsonl=self.run.metrics_jsonl, wandb=sink)
        if setup.attention.probed:
            writer.text(
                "attention_impl",
                f"auto chose **{setup.attention.impl}**; rejected: {json.dumps(setup.attention.rejected)}",
            )
        flops = perf.model_flops(cfg.model, cfg.data.seq_len)
        peak, peak_src = perf.device_peak_flops(cfg.model.dtype)
        writer.text("config", "```\n" + json.dumps(cfg.to_dict(), indent=2, default=str) + "\n```")
        self.say(
            f"model: {flops.params_total:,} params ({flops.params_non_embedding:,} non-embedding), "
            f"{cfg.model.value_residual}; {flops.per_token / 1e9:.3f} GFLOP/token; {jax.device_count()} "
            f"devices, mesh {dict(setup.mesh.shape)}; peak {peak / 1e12:.3f} TFLOP/s ({peak_src})"
        )
        self.say(group_sizes(setup.abstract_state.params).describe(cfg.train))
        every = cfg.checkpoint_every_steps
        self.say(
            f"checkpoints: every {every} steps and at the last"
            + ("" if cfg.checkpoint.every_steps else " (a tenth of train.steps, at most 1,000)" if every < 1000 else "")
            + f", to {self.run.path}; a rerun of this command resumes from the newest"
        )
        self.say(f"logs: tensorboard --logdir {self.run.path}")
        now = time.perf_counter()
        s = Session(
            cfg=cfg,
            setup=setup,
            compiled=compiled,
            compiled_telemetry=compiled_telemetry,
            corpus=corpus,
            data=data,
            eval_sets=eval_sets,
            eval_bytes=eval_bytes,
            ckpt=ckpt,
            state=state,
            start_step=start_step,
            writer=writer,
            flops=flops,
            peak=peak,
            schedule=lr_schedule(cfg.train),
            elapsed_before=progress.get("elapsed_s", 0.0),
            t_start=now,
            t_last=now,
            last_logged=start_step,
            hooks=self._hooks(cfg, bool(eval_sets)),
        )
        # The ledger from here on: the run directory is the run's (process 0 writes it).
        self.ledger.start_writing(enabled=self.is_main)
        self.ledger.resumed_at(start_step)
        if self.ledger.recomputed_steps:
            self.say(f"goodput: {self.ledger.recomputed_steps} steps after the checkpoint are recomputed")
        if "first_eval_loss" in progress:  # resumed: the closing line still reads from the run's first validation
            s.first_eval = {"eval/loss": float(progress["first_eval_loss"])}
        if start_step == 0 and eval_sets:
            self._enter("evaluation", 0)
            s.first_eval = s.last_eval = evaluate(s)
            writer.scalars(0, s.first_eval)
            self.say(f"step {0:>7}  validation loss {s.first_eval['eval/loss']:.4f}")
        return s

    # ------------------------------------------------------------------ the loop
    def train(self) -> int:
        self._install_signals()  # first: a SIGTERM during start-up also ends in a clean save-and-exit
        self.watchdog.start()
        end = "error"
        try:
            code = self._train()
            end = "finished" if code == 0 else "error"
            return code
        finally:
            self.watchdog.stop()
            self._restore_signals()
            if self.ledger.enabled:  # only once the run started: a refused start writes nothing
                totals = self.ledger.write(end=end)
                self.say(goodput.describe(totals))

    def _train(self) -> int:
        guard = self._startup_interrupt() if threading.current_thread() is threading.main_thread() else None
        try:
            self.session = s = self._start()
        except NothingToDo as done:
            self.say(done.message(self.workdir, self.asked.train))
            return 0
        finally:
            if guard is not None:
                guard.close()
        cfg = s.cfg
        end = self._end_step(s)
        step = s.start_step
        while step < end:
            self._enter("data", step + 1)
            batch = self._next_batch(s, step + 1)
            self._enter("step", step + 1)
            step_fn = (
                s.compiled if s.compiled_telemetry is None or not self._logs_at(s, step + 1) else s.compiled_telemetry
            )
            s.state, m = step_fn(s.state, batch)
            step += 1
            self.watchdog.progress(step)
            self.ledger.finished_step(step)
            s.pending.append(m)  # pulled to the host at the next log step (after the next dispatch)
            # Asked to stop: the checkpoint before any evaluation (a preemption's grace period is 30-90 s).
            stopping = self._should_stop(s, step)
            for hook in s.hooks:
                if hook.due(step, cfg.train.steps) and not (stopping and hook.phase == "evaluation"):
                    with self._phase(hook.phase, step) if hook.phase != "step" else contextlib.nullcontext():
                        try:
                            hook.run(s, step)
                        except Interrupted:  # a signal during the evaluation: it is dropped, the save comes now
                            stopping = True
                            break
            if stopping:
                with self._phase("checkpoint save", step):
                    self._save(s, step)
                    s.ckpt.wait()
                if step < cfg.train.steps:
                    self.say(f"preempted: saved a checkpoint at step {step}; rerun the same command to resume")
                else:
                    s.last_eval = None  # the final validation did not run: no closing loss from an older one
                    self.say(
                        f"stopped at the last step ({step}) and saved it; its final validation was skipped "
                        f"(`resformer evaluate --workdir={self.workdir}` scores it)"
                    )
                break
            if step % cfg.checkpoint_every_steps == 0 and step < end:
                with self._phase("checkpoint save", step):
                    self._save(s, step)
        else:
            if step > s.start_step and step not in s.ckpt.all_steps():
                with self._phase("checkpoint save", step):
                    self._save(s, step)
            if step < cfg.train.steps and step > s.start_step:
                self.say(
                    f"stopped at step {step}: config.train.stop_at={cfg.train.stop_at} (train.steps="
                    f"{cfg.train.steps}); rerun with a later --config.train.stop_at, or without it, to go on"
                )
        self._enter("finish", step)
        self._finish(s, step)
        return 0

    @staticmethod
    def _logs_at(s: Session, step: int) -> bool:
        return step % s.cfg.train.log_every == 0 or step == s.cfg.train.steps

    def _hooks(self, cfg: RunConfig, validating: bool) -> list[Hook]:
        """What runs after a step, when due: the log window; the validation sets; the zero-shot tasks."""
        say, workdir = self.say, self.workdir
        hooks = [Hook("log", cfg.train.log_every, "step", self._log)]
        if validating:
            stop = self._local_stop

            def validate_(s, k):
                return log_validation(s, k, say, lambda: self.faults.eval_batch(k) or stop())

            hooks.append(Hook("validation", cfg.train.eval_every, "evaluation", validate_))
        if cfg.eval.tasks:
            tasks = lambda s, k: evaluate_tasks(s, k, workdir, say)
            hooks.append(Hook("tasks", cfg.eval.tasks_every, "evaluation", tasks))
        return hooks

    def _next_batch(self, s: Session, step: int):
        """The batch of `step` (1-based), through the injected faults (train/faults.py; none unless set)."""
        self.faults.before_read(step)
        return global_batch(s, self.faults.batch(step, next(s.data), s.cfg.model.vocab_size))

    def _startup_interrupt(self) -> StartupInterrupt:
        """Start-up stops at once on a signal; a run directory this start made, holding no checkpoint, goes too."""
        existed = is_remote(self.workdir) or self.run.path.exists()

        def leftover() -> str | None:
            if existed or not self.run.path.exists() or self.run.finished_steps():
                return None
            return os.fspath(self.run.path)

        return StartupInterrupt(
            lambda name: (
                f"stopped during start-up ({name}) before any step; nothing was saved"
                + ("" if existed else f" and {self.workdir} was not left behind")
                + ". Rerun the same command to start"
            ),
            leftover,
        )

    def _install_signals(self):
        def handler(signum, frame):
            self.preempt = True

        self._old_handlers = {signal.SIGINT: signal.signal(signal.SIGINT, handler)}
        if jax.process_count() == 1:  # multi-host: JAX's preemption notifier handles SIGTERM
            self._old_handlers[signal.SIGTERM] = signal.signal(signal.SIGTERM, handler)

    def _restore_signals(self):
        for sig, h in self._old_handlers.items():
            signal.signal(sig, h)

    def _local_stop(self) -> bool:
        """A signal reached this single-process run: an evaluation stops between batches (several processes stop
        together only at a step's end, where they agree)."""
        return self.preempt and jax.process_count() == 1

    def _should_stop(self, s: Session, step: int) -> bool:
        flag = self.preempt
        if jax.process_count() > 1:
            flag = bool(np.any(multihost_utils.process_allgather(np.int32(flag))))
            flag = flag or s.ckpt.reached_preemption(step)
        return flag

    def _save(self, s: Session, step: int, force: bool = True):
        first_bad = int(jax.device_get(s.state.first_nonfinite_step))
        if first_bad >= 0 and not s.cfg.train.skip_nonfinite_steps:
            raise self._nonfinite(s, first_bad)
        progress = {
            "step": step,
            "tokens": step * s.setup.global_batch_shape[0] * s.cfg.data.seq_len,
            "elapsed_s": s.elapsed_before + time.perf_counter() - s.t_start,
        }
        if s.first_eval:
            progress["first_eval_loss"] = s.first_eval["eval/loss"]
        s.ckpt.save(step, s.state, s.data, s.setup.run.record(), progress, force=force)
        self.ledger.write()

    def _nonfinite(self, s: Session, step: int):
        last = [k for k in s.ckpt.all_steps() if k <= step]
        kept = f"the last good checkpoint (step {last[-1]}) is intact" if last else "no checkpoint was written"
        return NonFiniteError(
            f"the loss or gradient became non-finite at step {step}; training stopped and {kept}. Lower "
            "config.train.peak_lr or raise warmup_steps, or set --config.train.skip_nonfinite_steps=True to skip "
            "such steps"
        )

    def _end_step(self, s: Session) -> int:
        """Where this invocation stops: train.steps, or train.stop_at before it (0 steps when preempted during
        start-up or already there, saying so)."""
        cfg = s.cfg
        end = min(cfg.train.stop_at or cfg.train.steps, cfg.train.steps)
        if s.start_step >= end:
            self.say(NothingToDo(s.start_step).message(self.workdir, cfg.train))
        if self.preempt and s.start_step < end:
            self.say(
                "stopped during start-up (SIGTERM/SIGINT) before any step; nothing new to save. "
                "Rerun the same command to continue"
            )
            end = s.start_step
        return end

    def _log(self, s: Session, step: int):
        """The log hook: the steps since the last log, their scalars averaged (hooks.window_scalars), to
        TensorBoard and the console; the watchdog's window and the goodput ledger updated."""
        host, s.pending = jax.device_get(s.pending), []
        now = time.perf_counter()
        step_time = (now - s.t_last) / max(step - s.last_logged, 1)
        if s.last_logged > s.start_step:  # the first window holds the first step's one-off work
            self.watchdog.window(now - s.t_last)
        s.t_last, s.last_logged = now, step
        if sum(int(h["nonfinite"]) for h in host) and not s.cfg.train.skip_nonfinite_steps:
            raise self._nonfinite(s, int(jax.device_get(s.state.first_nonfinite_step)))
        vals = window_scalars(s, step, host, step_time)
        for i, h in enumerate(host):
            if s.state.spikes is not None and h["spike"]:
                self.say(
                    f"step {step - len(host) + i + 1}: loss spike skipped (loss {h['loss']:.4f}, grad norm "
                    f"{h['grad_norm']:.3f}, above {s.cfg.train.spike_sigma:g} standard deviations of the recent "
                    "steps); the update was not applied"
                )
        vals.update(goodput.scalars(self.ledger.write()))  # written at every log; its totals go to TensorBoard
        s.writer.scalars(step, vals)
        self.progress.update(
            step,
            vals["train/loss"],
            vals["perf/tokens_per_s"],
            step_time,
            f"  MFU {vals['perf/mfu_6n']:.2f} (6N) {vals['perf/mfu_model']:.2f} (model)"
            if np.isfinite(s.peak) and max(vals["perf/mfu_6n"], vals["perf/mfu_model"]) >= 0.005  # not 0.00
            else "",
        )

    def _finish(self, s: Session, step: int):
        s.ckpt.close()
        s.writer.flush()
        s.writer.close()
        if self.is_main and s.first_eval and s.last_eval and step == s.cfg.train.steps:
            self.say(
                f"done: validation loss {s.first_eval['eval/loss']:.4f} -> {s.last_eval['eval/loss']:.4f}. "
                f"TensorBoard: tensorboard --logdir {self.run.path}"
            )
        elif self.is_main and step == s.cfg.train.steps:
            self.say(f"done. TensorBoard: tensorboard --logdir {self.run.path}")
