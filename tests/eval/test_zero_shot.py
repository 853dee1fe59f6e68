"""Zero-shot scoring (eval/loglik.py) against the plain definition: every choice padded to the model's whole
context and scored from the full-vocabulary log-softmax. Same per-choice log-likelihoods (to 1e-5) and the same
accuracies on the six sample tasks, with batches padded only to bucketed lengths and the LM head applied only at
the continuation's positions."""

import json
import os

import jax
import numpy as np
import pytest
from commands import run_command
from demo_runs import tokenized_tiny_config

from resformer_jax.eval.loglik import ContinuationScorer, buckets, prepare, rows_per_batch
from resformer_jax.eval.zero_shot import TASKS, make_loglik_fn, read_task, score_items, to_items
from resformer_jax.model.config import ModelConfig
from resformer_jax.resolve import for_backend

# one worker runs this file, so its module fixtures are built once
pytestmark = pytest.mark.xdist_group("zero_shot")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def full_vocab_logliks(cfg, params, pairs_ids, max_len, batch=4):
    """The definition: each (context, continuation) cut from the left to max_len + 1 tokens, padded to max_len,
    log-softmax over the whole vocabulary at every position, the continuation's log-probabilities summed."""
    from resformer_jax.model import Transformer

    model = Transformer(for_backend(ModelConfig.of(cfg.model)))
    logprobs = jax.jit(lambda t: jax.nn.log_softmax(model.apply({"params": params}, t), axis=-1))
    out = []
    for b in range(0, len(pairs_ids), batch):
        chunk = [(ctx + cont)[-(max_len + 1) :] for ctx, cont in pairs_ids[b : b + batch]]
        ns = [min(len(cont), len(ids) - 1) for (_, cont), ids in zip(pairs_ids[b : b + batch], chunk)]
        toks = np.zeros((batch, max_len + 1), np.int32)
        for r, ids in enumerate(chunk):
            toks[r, : len(ids)] = ids
        lp = np.asarray(logprobs(toks[:, :-1]))
        for r, (ids, n) in enumerate(zip(chunk, ns)):
            L = len(ids)
            out.append(float(lp[r, np.arange(L - n - 1, L - 1), np.array(ids[L - n :])].sum()))
    return out


@pytest.fixture(scope="module")
def trained(shared_runs):
    """A tiny ResFormer trained a few steps on the demo corpus (which has a tokenizer), context 256: the session's
    shared run, which test_lm_eval.py reads too."""
    from resformer_jax.load import load_run

    wd = str(shared_runs.get(tokenized_tiny_config()))
    from resformer_jax.rundir import RunDir

    cfg, params, _ = load_run(wd)
    return wd, cfg, params, RunDir(wd).tokenizer()


@pytest.mark.slow
def test_scores_and_accuracies_equal_the_full_vocabulary_definition(trained, shared_data):
    _wd, cfg, params, tok = trained
    encode = lambda s: tok.encode(s, add_special_tokens=False).ids
    scorer = ContinuationScorer(cfg.model, params, cfg.model.max_seq_len, batch=0)
    fn = make_loglik_fn(scorer, encode)
    for task in TASKS:
        items = to_items(task, read_task(str(shared_data / "eval_samples"), task)[:10])
        pairs = [(c, x) for it in items for c, x in zip(it["contexts"], it["continuations"])]
        want = full_vocab_logliks(cfg, params, [(encode(c), encode(x)) for c, x in pairs], cfg.model.max_seq_len)
        got = fn(pairs)
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=task)
        ll = iter(want)
        assert score_items(items, fn) == score_items(items, lambda ps: [next(ll) for _ in ps]), task


@pytest.mark.slow  # over 12 s in the fast tier
def test_contexts_longer_than_the_model_are_cut_from_the_left_and_batches_sized_to_memory(trained):
    _wd, cfg, params, _ = trained
    rng = np.random.default_rng(0)
    max_len = cfg.model.max_seq_len
    pairs = [
        (list(rng.integers(1, 1000, n)), list(rng.integers(1, 1000, k)))
        for n, k in ((300, 5), (10, 3), (255, 1), (40, 70), (1, 1), (100, 9))
    ]
    want = full_vocab_logliks(cfg, params, pairs, max_len)
    scorer = ContinuationScorer(cfg.model, params, max_len, batch=0)
    got = scorer([prepare(c, x, max_len) for c, x in pairs])
    np.testing.assert_allclose([g for g, _ in got], want, rtol=1e-5, atol=1e-5)
    assert buckets(256) == [32, 64, 128, 256]
    m = cfg.model
    assert rows_per_batch(m, 2048, 64, 1 << 30, most=64) < rows_per_batch(m, 64, 8, 1 << 30, most=64) <= 64


@pytest.mark.slow
def test_evaluate_prints_progress_per_task(trained, shared_data, tmp_path):
    """The command: a line per task with items/s, the Table 1 layout, the same accuracies as the library call."""
    wd, cfg, params, _ = trained
    r = run_command(  # in-process
        "evaluate",
        f"--workdir={wd}",
        "--tasks=piqa,arc_easy",
        f"--task_data={shared_data / 'eval_samples'}",
        "--limit=12",
    )
    assert r.returncode == 0, r.stderr
    assert "piqa: 12 items in" in r.stderr and "items/s" in r.stderr and "arc_easy: 12 items" in r.stderr, r.stderr
    saved = json.load(open(os.path.join(wd, "eval", "zero_shot_step10.json")))
    from resformer_jax.eval.zero_shot import zero_shot

    ours = zero_shot(cfg, params, wd, ["piqa", "arc_easy"], str(shared_data / "eval_samples"), 12, log=lambda s: None)
    assert {t: saved["tasks"][t]["acc"] for t in ours} == {t: ours[t]["acc"] for t in ours}
