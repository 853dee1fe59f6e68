"""Zero-shot multiple choice as lm-evaluation-harness's default tasks score it.

Its notes (the reasons, what was measured): docs/modules.md.
"""

from __future__ import annotations

import glob
import json
import os
import re
import time

import numpy as np

from resformer_jax.errors import UserError
from resformer_jax.eval.loglik import ContinuationScorer, prepare
from resformer_jax.rundir import RunDir

TASKS = ("hellaswag", "piqa", "winogrande", "arc_easy", "arc_challenge", "openbookqa")


class TaskError(UserError):
    pass


def _hellaswag_pre(text: str) -> str:
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def to_items(task: str, docs: list[dict]) -> list[dict]:
    """Harness-style (contexts, continuations, gold) for each document."""
    items = []
    for d in docs:
        if task == "hellaswag":
            ctx = d["ctx_a"] + " " + d["ctx_b"].capitalize() if "ctx_a" in d else d["ctx"]
            label = d.get("activity_label")
            query = _hellaswag_pre((label + ": " if label else "") + ctx)
            conts = [" " + _hellaswag_pre(e) for e in d["endings"]]
            items.append({"contexts": [query] * len(conts), "continuations": conts, "gold": int(d["label"])})
        elif task == "piqa":
            q = f"Question: {d['goal']}\nAnswer:"
            items.append(
                {"contexts": [q, q], "continuations": [" " + d["sol1"], " " + d["sol2"]], "gold": int(d["label"])}
            )
        elif task == "winogrande":
            s = d["sentence"]
            i = s.index("_")
            cont = " " + s[i + 1 :].strip()
            items.append(
                {
                    "contexts": [s[:i] + d["option1"], s[:i] + d["option2"]],
                    "continuations": [cont, cont],
                    "gold": int(d["answer"]) - 1,
                }
            )
        elif task in ("arc_easy", "arc_challenge"):
            q = f"Question: {d['question']}\nAnswer:"
            texts = list(d["choices"]["text"])
            items.append(
                {
                    "contexts": [q] * len(texts),
                    "continuations": [" " + t for t in texts],
                    "gold": list(d["choices"]["label"]).index(d["answerKey"]),
                }
            )
        elif task == "openbookqa":
            texts = list(d["choices"]["text"])
            items.append(
                {
                    "contexts": [d["question_stem"]] * len(texts),
                    "continuations": [" " + t for t in texts],
                    "gold": list(d["choices"]["label"]).index(d["answerKey"].strip()),
                }
            )
        else:
            raise TaskError(f"unknown task {task!r}; known: {', '.join(TASKS)}")
    return items


def _task_files(task_data: str, task: str) -> list[str]:
    if not os.path.isdir(task_data):
        raise TaskError(f"--task_data {task_data!r} is not a folder; give the folder holding the tasks' files")
    cands = []
    for ext in ("jsonl", "parquet", "arrow"):
        cands += [os.path.join(task_data, f"{task}.{ext}")] + sorted(
            glob.glob(os.path.join(task_data, task, "**", f"*.{ext}"), recursive=True)
        )
    files = [f for f in cands if os.path.isfile(f)]
    if not files:
        raise TaskError(
            f"no {task}.jsonl/.parquet/.arrow under {task_data}; save the Hugging Face validation split "
            "there (nothing is downloaded)"
        )
    return files


def read_task(task_data: str, task: str) -> list[dict]:
    """Reads DIR/{task}.jsonl|.parquet|.arrow or DIR/{task}/* (Hugging Face datasets' field layout)."""
    path = _task_files(task_data, task)[0]
    if path.endswith(".jsonl"):
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    import pyarrow as pa

    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    with open(path, "rb") as f:  # datasets' .arrow files are IPC streams; accept the file format too
        try:
            return pa.ipc.open_stream(f).read_all().to_pylist()
        except pa.ArrowInvalid:
            f.seek(0)
            return pa.ipc.open_file(f).read_all().to_pylist()


def score_items(items: list[dict], loglik_fn) -> dict:
    """acc and acc_norm given loglik_fn([(context, continuation)]) -> [sum log p]."""
    pairs = [(c, x) for it in items for c, x in zip(it["contexts"], it["continuations"])]
    ll = list(loglik_fn(pairs))
    k = 0
    correct, correct_norm = 0, 0
    for it in items:
        n = len(it["continuations"])
        s = np.array(ll[k : k + n])
        k += n
        # acc_norm divides by the choice's length in characters without the " " that joins it to the context,
        # as lm-evaluation-harness does (len(doc_to_choice(doc)[i]))
        lengths = np.array([float(len(x[1:]) if x.startswith(" ") else len(x)) for x in it["continuations"]])
        correct += int(np.argmax(s) == it["gold"])
        correct_norm += int(np.argmax(s / lengths) == it["gold"])
    return {"acc": correct / len(items), "acc_norm": correct_norm / len(items), "n": len(items)}


def make_loglik_fn(scorer, encode):
    """loglik_fn([(context, continuation)]) -> [sum log p] over a ContinuationScorer (eval/loglik.py) and a
    tokenizer's encode. A continuation longer than the model's context is refused: scored in part, the number
    would not be the task's (the lm-eval adapter refuses them too)."""

    def loglik(pairs, progress=None):
        reqs, too_long = [], 0
        for ctx, cont in pairs:
            c_ids, x_ids = encode(ctx), encode(cont)
            too_long += len(x_ids) > scorer.max_len
            reqs.append(prepare(c_ids, x_ids, scorer.max_len))
        if too_long:
            raise TaskError(
                f"{too_long} of {len(pairs)} choices have a continuation longer than the context "
                f"({scorer.max_len} tokens); they cannot be scored whole: leave the task out or use a "
                "model with a longer max_seq_len"
            )
        return [ll for ll, _ in scorer(reqs, progress)]

    return loglik


def check_tasks(tasks: list[str], task_data: str | None) -> None:
    """Every task known and its file present, before any model is loaded."""
    if not task_data:
        raise TaskError("--tasks needs --task_data=DIR (a folder with each task's .jsonl/.parquet/.arrow file)")
    unknown = [t for t in tasks if t not in TASKS]
    if unknown:
        raise TaskError(f"unknown task {unknown[0]!r}; known: {', '.join(TASKS)}")
    for t in tasks:
        _task_files(task_data, t)


def zero_shot(cfg, params, workdir, tasks, task_data, limit, batch=0, log=print, tokenizer=None, mesh=None) -> dict:
    """{task: {acc, acc_norm, n}} of a run's parameters; a progress line per task (and every ~15 s of a long one)
    through `log`. `batch`: choices per forward pass (0: sized to memory). `tokenizer`: in place of the run's
    tokenizer.json; `mesh`: the parameters' mesh, when they are sharded across processes (ContinuationScorer)."""
    tok = tokenizer if tokenizer is not None else RunDir(workdir).tokenizer()
    if tok is None:
        raise TaskError(
            f"{workdir}/tokenizer.json not found: zero-shot scoring needs the run's tokenizer (a run "
            "on synthetic data has none)"
        )
    # the context the export declares (max_position_embeddings), so `lm_eval --model hf` scores the same items
    scorer = ContinuationScorer(cfg.model, params, cfg.model.max_seq_len, batch, mesh=mesh)
    fn = make_loglik_fn(scorer, lambda s: tok.encode(s, add_special_tokens=False).ids)
    out = {}
    for task in tasks:
        docs = read_task(task_data, task)
        if limit:
            docs = docs[:limit]
        items = to_items(task, docs)
        t0, last = time.perf_counter(), [time.perf_counter()]

        def progress(p, task=task, last=last):
            if time.perf_counter() - last[0] >= 15 and p.done < p.total:
                last[0] = time.perf_counter()
                log(f"{task}: {p.done}/{p.total} choices scored, {p.done / p.seconds:.1f} choices/s")

        out[task] = score_items(items, lambda pairs: fn(pairs, progress))
        took = time.perf_counter() - t0
        log(
            f"{task}: {len(items)} items in {took:.1f} s ({len(items) / max(took, 1e-9):.1f} items/s), "
            f"acc {out[task]['acc']:.4f}"
        )
    return out
