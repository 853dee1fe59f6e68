"""lm-evaluation-harness on this project's checkpoints: the adapter agrees with resformer_jax.evaluate."""

import os

import numpy as np
import pytest
from commands import run_command

# end-to-end: runs, commands, processes or compilers; one worker runs this file, so its module fixtures are built once
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("lm_eval")]

lm_eval = pytest.importorskip(
    "lm_eval", reason="lm-evaluation-harness is not installed (pip install -e '.[lm_eval]'; CI installs it)"
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TASKS_DIR = os.path.join(ROOT, "configs", "lm_eval_tasks")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="module")
def trained(shared_runs):
    from demo_runs import tokenized_tiny_config

    wd = str(shared_runs.get(tokenized_tiny_config()))  # the run test_zero_shot.py reads too, trained once
    from resformer_jax.eval.lm_eval_model import ResformerLM

    return wd, ResformerLM(workdir=wd, batch_size=8)


def _instances(kind, args_list):
    from lm_eval.api.instance import Instance

    return [Instance(request_type=kind, doc={}, arguments=a, idx=i) for i, a in enumerate(args_list)]


def test_per_item_loglikelihoods_equal_the_project_evaluator(trained, shared_data):
    from resformer_jax.eval.loglik import ContinuationScorer
    from resformer_jax.eval.zero_shot import make_loglik_fn, read_task, to_items

    _wd, lm = trained
    items = to_items("piqa", read_task(str(shared_data / "eval_samples"), "piqa")[:6]) + to_items(
        "hellaswag", read_task(str(shared_data / "eval_samples"), "hellaswag")[:3]
    )
    pairs = [(c, x) for it in items for c, x in zip(it["contexts"], it["continuations"])]
    ours = make_loglik_fn(ContinuationScorer(lm.model, lm.params, lm.max_length, 8), lm.encode)(pairs)
    got = lm.loglikelihood(_instances("loglikelihood", pairs))
    np.testing.assert_allclose([g for g, _ in got], ours, rtol=1e-5, atol=1e-4)
    assert (
        len(lm.scorer.buckets) <= 4
    )  # a few compiled lengths (powers of two from 32 to the 256 context), not one per request


def test_accuracy_on_the_sample_tasks_equals_evaluate(trained, shared_data):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from resformer_jax.eval.zero_shot import zero_shot

    wd, lm = trained
    tasks = ["hellaswag", "piqa", "winogrande", "arc_easy", "arc_challenge", "openbookqa"]
    limit = 8
    from resformer_jax.load import load_run

    ours = zero_shot(load_run(wd).cfg, lm.params, wd, tasks, str(shared_data / "eval_samples"), limit, 8)
    cwd = os.getcwd()
    os.chdir(ROOT)  # the shipped task files name ../shared/data/eval_samples relative to the repository
    try:
        res = simple_evaluate(
            model=lm,
            tasks=[f"{t}_local" for t in tasks],
            limit=limit,
            task_manager=TaskManager(include_path=TASKS_DIR, include_defaults=False),
        )
    finally:
        os.chdir(cwd)
    for t in tasks:
        r = res["results"][f"{t}_local"]
        assert r["acc,none"] == pytest.approx(ours[t]["acc"]), t
        if "acc_norm,none" in r:
            assert r["acc_norm,none"] == pytest.approx(ours[t]["acc_norm"]), t


def test_rolling_and_generation(trained):
    from reference import model_greedy

    _wd, lm = trained
    short = "def main():\n    return 0\n"  # within the context: one window, every token given all before it
    (rolled,) = lm.loglikelihood_rolling(_instances("loglikelihood_rolling", [(short,)]))
    full = [lm.eot_id] + lm.encode(short)
    direct = sum(lm._score([(full[:i], [full[i]])])[0][0] for i in range(1, len(full)))
    assert rolled == pytest.approx(direct, rel=1e-5, abs=1e-4)
    long = short * 40  # longer than the 256-token context: the harness's disjoint windows cover each token once
    from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

    ids = lm.encode(long)
    windows = [
        make_disjoint_window(w)
        for w in get_rolling_token_windows(
            token_list=ids, prefix_token=lm.eot_id, max_seq_len=lm.max_length, context_len=1
        )
    ]
    assert len(ids) > lm.max_length and sum(len(c) for _, c in windows) == len(ids)
    (rolled_long,) = lm.loglikelihood_rolling(_instances("loglikelihood_rolling", [(long,)]))
    assert rolled_long == pytest.approx(sum(lm._score([w])[0][0] for w in windows), rel=1e-5)
    prompt = "def main():"
    (out,) = lm.generate_until(_instances("generate_until", [(prompt, {"until": ["\n\n"], "max_gen_toks": 12})]))
    p = lm.encode(prompt)
    new = model_greedy(lm.model, lm.params, p, 12, eos_id=lm.eot_id)
    new = new[: new.index(lm.eot_id)] if lm.eot_id in new else new
    want = lm.tok.decode(new).split("\n\n")[0]
    assert out == want
    # a stop string across two tokens: the text ends right before it (the token that completes it is read)
    text = lm.tok.decode(new)
    cuts = [len(lm.tok.decode(new[:k])) for k in range(1, len(new))]
    b = next(b for b in cuts if 0 < b < len(text) and text.index(text[b - 1 : b + 1]) == b - 1)
    gen = [(prompt, {"until": [text[b - 1 : b + 1]], "max_gen_toks": 12})]
    assert lm.generate_until(_instances("generate_until", gen)) == [text[: b - 1]], (text, b)


def test_harness_command_line(trained, shared_data):
    # shared_data: the shipped piqa_local task reads ../shared/data/eval_samples (skips where it is absent)
    wd, _ = trained
    r = run_command(  # lm-eval's command line, in this process (HF_*_OFFLINE: tests/conftest.py)
        "harness",
        "--model",
        "resformer_jax",
        "--model_args",
        f"workdir={wd},batch_size=4",
        "--tasks",
        "piqa_local,arc_easy_gen_local",  # a multiple-choice task and a generation task (the engine)
        "--include_path",
        TASKS_DIR,
        "--limit",
        "4",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "piqa_local" in r.stdout and "acc" in r.stdout
    assert "arc_easy_gen_local" in r.stdout and "exact_match" in r.stdout


def test_context_defaults_to_the_exports_and_a_too_long_continuation_is_refused_with_a_count(trained):
    """The adapter's context is the model's max_seq_len (the export's max_position_embeddings, what the stock
    `lm_eval --model hf` uses), not data.seq_len; a continuation longer than it is not scored in part."""
    _wd, lm = trained
    from resformer_jax.load import load_run

    assert lm.max_length == lm.model.max_seq_len != load_run(_wd).cfg.data.seq_len
    long_cont = " x" * (lm.max_length + 5)
    reqs = _instances("loglikelihood", [("a", " b"), ("a", long_cont), ("c", long_cont)])
    with pytest.raises(ValueError, match=r"2 of 3 requests have a continuation longer than the context"):
        lm.loglikelihood(reqs)


def test_generate_until_batches_200_prompts_through_the_engine(trained):
    """200 prompts of mixed lengths: one engine, a handful of compiled shapes (buckets, not one per length), and
    the texts cache-free greedy decoding (tests/reference.model_greedy) gives, on a sample of them."""
    from reference import model_greedy

    _wd, lm = trained
    rng = np.random.default_rng(0)
    words = ["def", "return", "class", "import", "for", "while", "if", "else", "print"]
    words += ["value", "residual", "layer", "cache", "token"]
    prompts = [" ".join(rng.choice(words, int(n))) for n in rng.integers(1, 60, 200)]
    outs = lm.generate_until(
        _instances("generate_until", [(p, {"until": ["\n\n"], "max_gen_toks": 8}) for p in prompts])
    )
    assert len(outs) == 200
    assert len(lm._engine.stats.compiled_shapes) <= 12, lm._engine.stats.compiled_shapes
    assert lm._engine.pool.used == 0
    for i in range(0, 200, 25):
        p = lm.encode(prompts[i])
        new = model_greedy(lm.model, lm.params, p, 8, eos_id=lm.eot_id)
        new = new[: new.index(lm.eot_id)] if lm.eot_id in new else new
        assert outs[i] == lm.tok.decode(new).split("\n\n")[0], f"prompt {i} ({len(p)} tokens)"


def test_an_exported_folder_scores_and_generates_as_its_run(trained, tmp_path):
    """`workdir=` an export (what serve and generate take too, through load.load_model): the same log-likelihoods
    and greedy text as the run it was exported from."""
    from resformer_jax.eval.lm_eval_model import ResformerLM
    from resformer_jax.hf.run_export import export_run
    from resformer_jax.load import load_run
    from resformer_jax.rundir import RunDir

    wd, lm = trained
    export_run(RunDir(wd), load_run(wd), str(tmp_path / "hf"))
    exported = ResformerLM(workdir=str(tmp_path / "hf"), batch_size=8)
    assert exported.step is None and exported.max_length == lm.max_length
    pairs = [("The first", " line of the file"), ("import os", "\nimport sys"), ("a", " b")]
    np.testing.assert_allclose(
        [x for x, _ in exported.loglikelihood(_instances("loglikelihood", pairs))],
        [x for x, _ in lm.loglikelihood(_instances("loglikelihood", pairs))],
        rtol=1e-5,
        atol=1e-4,
    )
    gen = [("def main(", {"until": ["\n\n"], "max_gen_toks": 8, "do_sample": False})]
    assert exported.generate_until(_instances("generate_until", gen)) == lm.generate_until(
        _instances("generate_until", gen)
    )
