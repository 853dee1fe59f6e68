"""Evaluate a checkpoint: per-domain validation loss (paper Table 5) and zero-shot accuracy (Table 1).

  resformer evaluate --workdir=RUN [--step N] --data=PREPARED_DIR
  resformer evaluate --workdir=RUN --tasks=hellaswag,piqa,winogrande,arc_easy,arc_challenge,openbookqa \\
      --task_data=DIR [--limit N]

Writes RUN/eval/*.json and TensorBoard scalars under RUN/tb.
"""

from __future__ import annotations

import dataclasses
import sys
import time

from absl import flags

from resformer_jax.commands import common as cli

flags.DEFINE_string("workdir", None, "Run directory.", required=True)
flags.DEFINE_integer("step", None, "Checkpoint step (default: newest).")
flags.DEFINE_string("data", None, "Prepared corpus folder for validation loss (default: the run's own data).")
flags.DEFINE_string("tasks", None, "Comma-separated zero-shot tasks.")
flags.DEFINE_string("task_data", None, "Folder with the tasks' files (.jsonl/.parquet/.arrow).")
flags.DEFINE_integer("limit", 0, "Items per task (0: all).")
flags.DEFINE_integer("batch", 0, "Sequences per forward pass (0: zero-shot sizes it to memory; validation: 16).")
FLAGS = flags.FLAGS


def validation_table(cfg, params, data: str | None, batch: int, say=print) -> dict:
    import jax
    import numpy as np

    from resformer_jax.data.pipeline import validation_sets
    from resformer_jax.model import Transformer
    from resformer_jax.train.step import make_eval_step

    if data:
        cfg = cfg.replace(data=dataclasses.replace(cfg.data, path=data, source="array_record"))
    # the training loop's own validation step: a run's data.document_start_loss counts here as it did there
    f = jax.jit(make_eval_step(Transformer(cfg.model), cfg.train.loss_chunk_len, cfg.data.document_start_loss))
    sets = validation_sets(cfg, batch, 0, all_records=True)
    total, done, t0, last = sum(len(b) for b in sets.values()), 0, time.perf_counter(), time.perf_counter()
    say(f"validation: {total} batches of {batch} sequences over {len(sets)} domains (the first compiles) ...")
    table = {}
    for dom, batches in sets.items():
        summed, counted = 0.0, 0  # a domain's loss over every target of its split: each batch's mean x its targets
        for b in batches:
            # the last batch, short of `batch` sequences: filled with rows whose targets are left out (one shape)
            rows = np.arange(batch) < len(b)
            full = np.concatenate([b, np.zeros((batch - len(b), b.shape[1]), b.dtype)]) if len(b) < batch else b
            loss, targets = f(params, full, rows)
            summed += float(loss) * int(targets)
            counted += int(targets)
            done += 1
            if time.perf_counter() - last > 10 or done == total:  # a word at least every 10 s
                last = time.perf_counter()
                say(f"validation: {done}/{total} batches ({dom}), {last - t0:.0f} s")
        table[dom] = summed / max(counted, 1)
    table["mean"] = float(np.mean(list(table.values())))
    return table


def main(argv):
    cli.start()
    with cli.exit_on_user_error():
        evaluate()


def evaluate():
    from resformer_jax.eval.zero_shot import check_tasks, zero_shot
    from resformer_jax.load import load_run
    from resformer_jax.metrics import Writer
    from resformer_jax.rundir import RunDir
    from resformer_jax.storage import write_json

    if FLAGS.batch < 0 or FLAGS.limit < 0:
        raise cli.ConfigFlagError(
            f"--batch={FLAGS.batch} --limit={FLAGS.limit}: must be >= 0 (0: sized to memory; all items)"
        )
    tasks = [t.strip() for t in (FLAGS.tasks or "").split(",") if t.strip()]
    if FLAGS.tasks is not None:
        check_tasks(tasks, FLAGS.task_data)  # names and files first: nothing is loaded for a typo
    if FLAGS.data:
        from resformer_jax.data.records import load_metadata

        load_metadata(FLAGS.data)
    run = RunDir(FLAGS.workdir)
    cfg, params, step = load_run(run.workdir, FLAGS.step)
    out_dir = run.eval_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    writer = Writer(run.tensorboard)
    say = lambda s: print(s, file=sys.stderr, flush=True)
    if tasks:
        res = zero_shot(cfg, params, FLAGS.workdir, tasks, FLAGS.task_data, FLAGS.limit, FLAGS.batch, log=say)
        print(f"zero-shot accuracy at step {step} (Table 1 layout)")
        print(f"{'task':<15}{'acc':>8}{'acc_norm':>10}{'n':>6}")
        for t, r in res.items():
            print(f"{t:<15}{r['acc']:>8.4f}{r['acc_norm']:>10.4f}{r['n']:>6}")
        avg = sum(r["acc"] for r in res.values()) / len(res)
        print(f"{'average':<15}{avg:>8.4f}")
        writer.scalars(step, {f"zero_shot/{t}/{k}": r[k] for t, r in res.items() for k in ("acc", "acc_norm")})
        path = out_dir / f"zero_shot_step{step}.json"
        write_json(path, {"step": step, "tasks": res, "average_acc": avg})
        print(f"wrote {path}")
    if FLAGS.data or not tasks:
        table = validation_table(cfg, params, FLAGS.data, FLAGS.batch or 16, say=say)
        print(f"validation loss at step {step} (Table 5 layout)")
        print("  ".join(f"{d.replace('RedPajama', ''):>12}" for d in table))
        print("  ".join(f"{v:>12.4f}" for v in table.values()))
        writer.scalars(step, {f"eval_full/{d}/loss": v for d, v in table.items()})
        path = out_dir / f"validation_step{step}.json"
        write_json(path, {"step": step, "loss": table})
        print(f"wrote {path}")
    writer.close()


def cli_main():
    cli.run_app(main, sys.modules[__name__])
