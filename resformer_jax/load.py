"""A finished run's parameters read back for inference and analysis (generate, evaluate, export, analyze, serve,
the lm-eval adapter): `load_run`, which reads only, and names a damaged checkpoint without moving it; `load_model`,
a run or an exported folder for the decode engine."""

from __future__ import annotations

import contextlib
import gc
import logging
import sys
import threading
from collections.abc import Callable
from typing import Any, NamedTuple

from etils import epath

from resformer_jax.checkpoint import CheckpointError
from resformer_jax.config import RunConfig, with_defaults
from resformer_jax.errors import one_line
from resformer_jax.model.config import ModelConfig
from resformer_jax.resolve import for_backend, model_config, resolve_attention
from resformer_jax.rundir import RunDir


@contextlib.contextmanager
def _library_reports_held():
    """While a reader tries a checkpoint: Orbax's own error logs, its threads' tracebacks and the failed reads it
    leaves behind (coroutines and futures whose errors nobody retrieved, reported by asyncio and the interpreter when
    they are collected) are held back: a damaged checkpoint's failure is said in one line by load_run; a reader
    writes nothing into the run."""
    loggers = [logging.getLogger(name) for name in ("absl", "orbax", "asyncio")]
    levels = [lg.level for lg in loggers]
    hooks = threading.excepthook, sys.unraisablehook
    for lg in loggers:
        lg.setLevel(logging.CRITICAL)
    threading.excepthook = lambda args: None
    sys.unraisablehook = lambda args: None
    try:
        yield
    finally:
        gc.collect()  # the failed reads' leftovers are reported now, while held, not at a later collection
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
        threading.excepthook, sys.unraisablehook = hooks


class LoadedRun(NamedTuple):
    cfg: RunConfig  # the run's config, typed; its model's attention impl and matmul forms resolved for this machine
    params: Any
    step: int


def load_run(
    workdir: str,
    step: int | None = None,
    *,
    attention_impl: str | None = None,
    log: Callable[[str], Any] = lambda s: None,
    warn: Callable[[str], Any] = lambda s: print(s, file=sys.stderr, flush=True),
) -> LoadedRun:
    """A run's checkpoint (newest that restores, or `step`) on the default device, for inference and analysis.
    `attention_impl` overrides the run's impl (analyze uses `reference`); `auto` is probed here.

    Reads only: a damaged newest checkpoint is named through `warn` and the newest one that restores is used (as
    training does), but nothing is moved, since another process may be training in the run."""
    run = RunDir(workdir)
    if not run.checkpoints.is_dir():
        from resformer_jax.hf.llama_import import is_export

        if is_export(workdir):
            raise CheckpointError(
                f"{workdir} is a folder `resformer export` wrote, not a run directory: this command reads a run's "
                "checkpoints (generate, serve and `resformer harness` take an export, analyze as --hf_model); give "
                "the run's --workdir"
            )
        _no_run(run, workdir)
    with run.checkpointer(read_only=True) as ck:
        steps = ck.all_steps()
        if not steps:
            raise CheckpointError(
                f"no checkpoint in {ck.dir}; train first (python -m resformer_jax.main --workdir={workdir})"
            )
        if step is not None and step not in steps:
            raise CheckpointError(f"no checkpoint at step {step} in {ck.dir}; available: {steps}")
        failures = []
        for candidate in [step] if step is not None else list(reversed(steps)):
            try:
                cfg = RunConfig.of(with_defaults(ck.read_config(candidate)), strict=False)
                with _library_reports_held():
                    params = ck.restore_params(candidate)
            except Exception as e:
                failures.append((candidate, one_line(e, 300)))
                continue
            if failures:
                warn(
                    f"WARNING: checkpoint at step {failures[0][0]} ({ck.dir}/{failures[0][0]}) does not restore "
                    f"({failures[0][1]}); using step {candidate}, the newest that restores (pass --step={candidate}"
                    " to choose it; nothing in the run was moved)"
                )
            step = candidate
            break
        else:
            if len(failures) == 1 and len(steps) > 1:
                others = [s for s in steps if s != failures[0][0]]
                raise CheckpointError(
                    f"the checkpoint at step {failures[0][0]} in {ck.dir} does not restore "
                    f"({failures[0][1]}); pass another --step (available: {others})"
                )
            raise CheckpointError(
                f"none of the checkpoints in {ck.dir} restores ({failures}); retrain, or "
                "restore the run directory from a copy"
            )
    choice = resolve_attention(cfg, override=attention_impl, batch=1, log=log)
    # readers build the model from cfg.model: the attention impl and matmul forms resolved for this machine
    return LoadedRun(cfg.replace(model=model_config(cfg, choice)), params, step)


class LoadedModel(NamedTuple):
    model: ModelConfig
    params: Any
    step: int | None  # None: an export's one set of weights
    tokenizer: Any  # a tokenizers.Tokenizer, or None (a run trained on token ids)
    trained_len: int | None  # the sequence length the run trained at (None: an export does not say)


def _no_run(run: RunDir, workdir: str):
    what = "has no checkpoints/ folder" if run.path.is_dir() else "does not exist"
    raise CheckpointError(
        f"run directory {workdir} {what}; check --workdir (train first with "
        f"python -m resformer_jax.main --workdir={workdir})"
    )


def check_model_path(path: str) -> None:
    """load_model's error where `path` is neither a run directory nor an export, before anything is loaded (the
    harness says so before lm-eval indexes its tasks)."""
    from resformer_jax.hf.llama_import import is_export

    run = RunDir(path)
    if not run.checkpoints.is_dir() and not is_export(path):
        _no_run(run, path)


def load_model(path: str, step: int | None = None) -> LoadedModel:
    """What the decode engine runs (serve, generate, the lm-eval adapter): a run directory's checkpoint (load_run)
    or a folder `resformer export` wrote (its weights as written, its tokenizer.json: ours carry the corpus's)."""
    from resformer_jax.hf.llama_import import is_export, load_hf_llama

    if is_export(path):
        import jax
        from tokenizers import Tokenizer

        if step is not None:
            raise CheckpointError(f"--step={step}: {path} is an exported folder with one set of weights; drop --step")
        model, params = load_hf_llama(path, dtype="auto")  # a bfloat16 export decodes (and caches) in bfloat16
        params = jax.device_put(params)  # numpy as read: a jitted step would copy every weight in on every call
        model = for_backend(model)  # no trained length to probe `auto` at: the backend's unprobed choice
        tok = epath.Path(path) / "tokenizer.json"  # local or on object storage, as the weights
        return LoadedModel(model, params, None, Tokenizer.from_str(tok.read_text()) if tok.is_file() else None, None)
    cfg, params, step = load_run(path, step)
    return LoadedModel(cfg.model, params, step, RunDir(path).tokenizer(), cfg.data.seq_len)
