"""Zero-shot multiple choice as lm-evaluation-harness's default tasks score it.

Each item becomes (context, [continuations], gold). A choice's score is the
model's summed log-likelihood of its continuation tokens given the context;
acc takes the argmax, acc_norm the argmax of score / len(choice in characters,
without the joining space), the harness's length normalisation. Prompts follow the harness:

  hellaswag      preprocess(activity_label + ": " + ctx_a + " " + ctx_b.capitalize()) -> " " + preprocess(ending)
  piqa           "Question: {goal}\nAnswer:" -> " " + sol
  winogrande     sentence[:blank] + option -> " " + sentence[blank+1:].strip()  (partial scoring)
  arc_*          "Question: {question}\nAnswer:" -> " " + choice text
  openbookqa     question_stem -> " " + choice text
"""
from __future__ import annotations

import glob
import json
import os
import re

import numpy as np
from resformer_jax.errors import UserError

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
            items.append({"contexts": [q, q], "continuations": [" " + d["sol1"], " " + d["sol2"]],
                          "gold": int(d["label"])})
        elif task == "winogrande":
            s = d["sentence"]
            i = s.index("_")
            cont = " " + s[i + 1:].strip()
            items.append({"contexts": [s[:i] + d["option1"], s[:i] + d["option2"]], "continuations": [cont, cont],
                          "gold": int(d["answer"]) - 1})
        elif task in ("arc_easy", "arc_challenge"):
            q = f"Question: {d['question']}\nAnswer:"
            texts = list(d["choices"]["text"])
            items.append({"contexts": [q] * len(texts), "continuations": [" " + t for t in texts],
                          "gold": list(d["choices"]["label"]).index(d["answerKey"])})
        elif task == "openbookqa":
            texts = list(d["choices"]["text"])
            items.append({"contexts": [d["question_stem"]] * len(texts), "continuations": [" " + t for t in texts],
                          "gold": list(d["choices"]["label"]).index(d["answerKey"].strip())})
        else:
            raise TaskError(f"unknown task {task!r}; known: {', '.join(TASKS)}")
    return items


def read_task(task_data: str, task: str) -> list[dict]:
    """Reads DIR/{task}.jsonl|.parquet|.arrow or DIR/{task}/* (Hugging Face datasets' field layout)."""
    cands = []
    for ext in ("jsonl", "parquet", "arrow"):
        cands += [os.path.join(task_data, f"{task}.{ext}")] + sorted(
            glob.glob(os.path.join(task_data, task, "**", f"*.{ext}"), recursive=True))
    files = [f for f in cands if os.path.isfile(f)]
    if not files:
        raise TaskError(f"no {task}.jsonl/.parquet/.arrow under {task_data}; save the Hugging Face validation split "
                        "there (nothing is downloaded)")
    path = files[0]
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
        s = np.array(ll[k:k + n])
        k += n
        # acc_norm divides by the choice's length in characters without the " " that joins it to the context,
        # as lm-evaluation-harness does (len(doc_to_choice(doc)[i]))
        lengths = np.array([float(len(x[1:]) if x.startswith(" ") else len(x)) for x in it["continuations"]])
        correct += int(np.argmax(s) == it["gold"])
        correct_norm += int(np.argmax(s / lengths) == it["gold"])
    return {"acc": correct / len(items), "acc_norm": correct_norm / len(items), "n": len(items)}


def make_loglik_fn(apply_logits, encode, max_len: int, batch: int = 16):
    """Builds loglik_fn from a jitted tokens[B, L] -> log-probs and a tokenizer encode."""
    def loglik(pairs):
        reqs, too_long = [], 0
        for ctx, cont in pairs:
            c_ids, x_ids = encode(ctx), encode(cont)
            too_long += len(x_ids) > max_len
            ids = (c_ids + x_ids)[-(max_len + 1):]  # keep the continuation, cut the context from the left
            n_cont = min(len(x_ids), len(ids) - 1)
            reqs.append((ids, n_cont))
        if too_long:  # scored in part, the number would not be the task's (the lm-eval adapter refuses them too)
            raise TaskError(f"{too_long} of {len(pairs)} choices have a continuation longer than the context "
                            f"({max_len} tokens); they cannot be scored whole: leave the task out or use a model "
                            "with a longer max_seq_len")
        out = []
        for b in range(0, len(reqs), batch):
            chunk = reqs[b:b + batch]
            toks = np.zeros((batch, max_len + 1), np.int32)
            for r, (ids, _) in enumerate(chunk):
                toks[r, :len(ids)] = ids
            logp = np.asarray(apply_logits(toks[:, :-1]))  # [batch, max_len, V] log-softmax
            for r, (ids, n) in enumerate(chunk):
                L = len(ids)
                tgt = np.array(ids[L - n:])
                pos = np.arange(L - n - 1, L - 1)
                out.append(float(logp[r, pos, tgt].sum()))
        return out
    return loglik


def model_logprobs(cfg, params):
    """(model, jitted tokens [B, T] -> log-softmax [B, T, V]) of a run's parameters."""
    import jax
    from resformer_jax.model import Transformer
    model = Transformer(cfg.model)

    @jax.jit
    def logprobs(tokens):
        return jax.nn.log_softmax(model.apply({"params": params}, tokens), axis=-1)
    return model, logprobs


def zero_shot(cfg, params, workdir, tasks, task_data, limit, batch) -> dict:
    from resformer_jax.rundir import RunDir
    tok = RunDir(workdir).tokenizer()
    if tok is None:
        raise FileNotFoundError(f"{workdir}/tokenizer.json not found: zero-shot scoring needs the run's tokenizer")
    _, logprobs = model_logprobs(cfg, params)
    fn = make_loglik_fn(logprobs, lambda s: tok.encode(s, add_special_tokens=False).ids, cfg.model.max_seq_len, batch)  # the context the export declares
    out = {}
    for task in tasks:
        docs = read_task(task_data, task)
        if limit:
            docs = docs[:limit]
        out[task] = score_items(to_items(task, docs), fn)
    return out
