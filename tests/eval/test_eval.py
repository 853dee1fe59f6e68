"""Evaluation and analysis: closed forms, readers, scoring, and the three commands end to end."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from commands import run_command
from corpus_sample import trimmed_slimpajama

from resformer_jax.analysis import measures
from resformer_jax.analysis.runs import relative_curves
from resformer_jax.eval.zero_shot import TASKS, read_task, score_items, to_items
from resformer_jax.model.config import ModelConfig
from resformer_jax.resolve import for_backend

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_entropy_of_uniform_causal_attention():
    l = 5
    A = np.tril(np.ones((l, l))) / np.arange(1, l + 1)[:, None]
    a = A.mean(axis=0)
    a = a / a.sum()
    want = -(a * np.log(a)).sum()
    assert measures.token_importance_entropy(A) == pytest.approx(want, rel=1e-12)
    assert measures.uniform_causal_entropy(l) == pytest.approx(want, rel=1e-12)
    # All attention on the first token: importance is one-hot, entropy 0.
    B = np.zeros((l, l))
    B[:, 0] = 1
    assert measures.token_importance_entropy(B) == 0.0
    assert measures.first_token_share(B) == 1.0


def test_similarity_closed_forms():
    h = np.tile(np.array([[1.0, 2.0, 3.0]]), (6, 1))
    assert measures.mean_token_similarity(h) == pytest.approx(1.0)
    assert measures.mean_token_similarity(np.eye(4)) == pytest.approx(0.0, abs=1e-12)
    x = np.random.default_rng(0).normal(size=(7, 5))
    u = x / np.linalg.norm(x, axis=1, keepdims=True)
    sims = [u[i] @ u[j] for i in range(7) for j in range(7) if i != j]
    assert measures.mean_token_similarity(x) == pytest.approx(np.mean(sims))


def test_spectrum_equals_eigvalsh():
    v = np.random.default_rng(1).normal(size=(50, 8))
    want = np.sort(np.linalg.eigvalsh(v.T @ v / 50))[::-1]
    np.testing.assert_allclose(measures.value_spectrum(v), want, rtol=1e-10)


def test_multiple_choice_scoring_hand_count():
    items = [
        {"contexts": ["c"] * 2, "continuations": [" a", " bbbbbbbb"], "gold": 1},  # acc wrong, norm right
        {"contexts": ["c"] * 3, "continuations": [" x", " y", " z"], "gold": 2},  # both right
        {"contexts": ["c"] * 2, "continuations": [" long one", " s"], "gold": 0},  # both wrong
    ]
    ll = {" a": -1.0, " bbbbbbbb": -2.0, " x": -5.0, " y": -4.0, " z": -1.0, " long one": -30.0, " s": -3.0}
    r = score_items(items, lambda pairs: [ll[c] for _, c in pairs])
    assert r == {"acc": 1 / 3, "acc_norm": 2 / 3, "n": 3}


def test_harness_prompts():
    it = to_items("piqa", [{"goal": "To x,", "sol1": "a.", "sol2": "b.", "label": 1}])[0]
    assert it["contexts"][0] == "Question: To x,\nAnswer:" and it["continuations"] == [" a.", " b."] and it["gold"] == 1
    it = to_items(
        "winogrande", [{"sentence": "A beat B because _ was strong.", "option1": "A", "option2": "B", "answer": "2"}]
    )[0]
    assert it["contexts"] == ["A beat B because A", "A beat B because B"]
    assert it["continuations"] == [" was strong.", " was strong."] and it["gold"] == 1
    it = to_items(
        "hellaswag",
        [
            {
                "activity_label": "Cooking",
                "ctx_a": "He cuts.",
                "ctx_b": "then he",
                "endings": ["eats [title] it", "b"],
                "label": "0",
            }
        ],
    )[0]
    assert it["contexts"][0] == "Cooking: He cuts. Then he" and it["continuations"][0] == " eats. it"


def test_readers_on_shared_samples_and_written_formats(shared_data, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    for task in TASKS:
        docs = read_task(str(shared_data / "eval_samples"), task)
        assert len(docs) == 40
        items = to_items(task, docs)
        assert all(0 <= it["gold"] < len(it["continuations"]) for it in items)
        table = pa.Table.from_pylist(docs)
        d = tmp_path / task
        d.mkdir()
        pq.write_table(table, d / "validation.parquet")
        assert read_task(str(tmp_path), task) == docs
        with pa.OSFile(str(tmp_path / f"{task}.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as w:
            w.write_table(table)
        (d / "validation.parquet").unlink()
        assert read_task(str(tmp_path), task) == docs


def test_relative_curve_of_run_against_itself_is_zero():
    curve = {s: 5.0 - 0.01 * s + 0.1 * np.sin(s) for s in range(1, 200)}
    steps, rel = relative_curves(curve, {"self": curve}, smooth=10)["self"]
    assert len(steps) == 199 and max(abs(x) for x in rel) == 0.0
    lower = {s: v - 0.5 for s, v in curve.items()}
    _, rel = relative_curves(curve, {"lower": lower}, smooth=10)["lower"]
    np.testing.assert_allclose(rel, -0.5)


@pytest.mark.slow
def test_three_commands_end_to_end(tmp_path, shared_data):
    from resformer_jax.commands.training import run
    from resformer_jax.data_prep.prepare import prepare
    from resformer_jax.presets import tiny_config

    sample = trimmed_slimpajama(shared_data, tmp_path / "sample", docs_per_domain=3, chars_per_doc=6000)
    prepare([str(sample)], "train:400", str(tmp_path / "data"), seq_len=32, quiet=True)
    data = str(tmp_path / "data")
    runs = {}
    for mode in ("none", "resformer"):
        c = tiny_config(mode)
        c.data.source, c.data.path, c.data.seq_len, c.model.vocab_size = "array_record", data, 32, 400
        c.train.steps, c.train.log_every, c.mesh.num_devices = 20, 2, 1
        runs[mode] = str(tmp_path / mode)
        assert run(c, runs[mode]) == 0
    r = run_command(
        "evaluate",
        f"--workdir={runs['resformer']}",
        f"--data={data}",
        "--tasks=piqa,winogrande,arc_easy",
        f"--task_data={shared_data / 'eval_samples'}",
        "--limit=6",
    )
    assert r.returncode == 0, r.stderr
    assert "Table 5" in r.stdout and "Table 1" in r.stdout and "piqa" in r.stdout
    ev = json.load(open(os.path.join(runs["resformer"], "eval", "validation_step20.json")))
    assert "mean" in ev["loss"] and len(ev["loss"]) >= 3 and all(np.isfinite(v) for v in ev["loss"].values())
    # Table 5's losses count every validation record once, whatever --batch: the full forward's mean over them all
    r = run_command("evaluate", f"--workdir={runs['resformer']}", f"--data={data}", "--batch=5")
    assert r.returncode == 0, r.stderr
    by5 = json.load(open(os.path.join(runs["resformer"], "eval", "validation_step20.json")))["loss"]
    from resformer_jax.data.pipeline import validation_sets
    from resformer_jax.load import load_run
    from resformer_jax.model import Transformer

    cfg, params, _ = load_run(runs["resformer"])
    meta = json.load(open(os.path.join(data, "metadata.json")))["splits"]["validation"]
    sizes = []
    forward = jax.jit(lambda rows: Transformer(cfg.model).apply({"params": params}, rows))
    for dom, batches in validation_sets(cfg, 10**6, 0, all_records=True).items():
        (rows,) = batches
        assert len(rows) == meta[dom]["sequences"], dom
        sizes.append(len(rows))
        logp = jax.nn.log_softmax(forward(rows[:, :-1]).astype(jnp.float32))
        want = -float(jnp.mean(jnp.take_along_axis(logp, rows[:, 1:, None], axis=-1)))
        assert ev["loss"][dom] == pytest.approx(want, abs=2e-5) and by5[dom] == pytest.approx(want, abs=2e-5), dom
    assert any(n % 5 and n % 16 for n in sizes), f"{sizes}: every domain fills whole batches, so this cannot tell"
    zs = json.load(open(os.path.join(runs["resformer"], "eval", "zero_shot_step20.json")))
    assert zs["tasks"]["piqa"]["n"] == 6
    r = run_command(
        "analyze",
        f"--workdir={runs['resformer']}",
        f"--workdir={runs['none']}",
        f"--data={data}",
        "--num_sequences=8",
        f"--out={tmp_path / 'an'}",
    )
    assert r.returncode == 0, r.stderr
    an = json.load(open(tmp_path / "an" / "analysis.json"))
    assert len(an) == 2 and len(an[0]["layers"]["entropy"]) == 3 and len(an[0]["layers"]["spectrum"][0]) == 64
    # the paper's protocol: training sequences by default, V_n's spectrum per example, Eq. 13 also on the embedding and
    # final-norm outputs
    assert an[0]["split"] == "train" and an[0]["spectrum_value"] == "each layer's own V_n"
    assert len(an[0]["layers"]["similarity_all_hidden_states"]) == 3 + 2
    assert an[0]["similarity_all_hidden_states_are"][0] == "embedding output"
    fig3 = an[1]["layers"]["fig3_eq3_vs_eq2"]  # the vanilla run (Fig. 3 is measured on a trained baseline)
    assert fig3[0] is None and all(-1 <= x <= 1 for x in fig3[1:])
    assert os.path.getsize(tmp_path / "an" / "fig3_mapping_similarity.png") > 1000
    for f in ("entropy.png", "similarity.png", "spectrum.png"):
        assert os.path.getsize(tmp_path / "an" / f) > 1000
    r = run_command("compare", "--baseline", runs["none"], runs["resformer"], runs["none"], "--smooth=3",
                    f"--out={tmp_path / 'cmp'}")  # fmt: skip
    assert r.returncode == 0, r.stderr
    rel = json.load(open(tmp_path / "cmp" / "relative_train_loss.json"))
    assert max(abs(x) for x in rel["none"]["relative"]) == 0.0
    assert os.path.getsize(tmp_path / "cmp" / "relative_train_loss.png") > 1000
    assert os.listdir(tmp_path / "cmp" / "tb" / "resformer")


@pytest.mark.slow  # over 12 s in the fast tier
def test_streamed_analysis_equals_measures_over_every_kept_tensor(tmp_path):
    """analyze keeps running means (memory: one batch); its result equals the measures computed the way it used
    to, holding every example's values and averaging at the end (Eq. 12's per-example spectra included); Fig. 9
    right's largest eigenvalue is the spectrum's first entry; a cross_layer run is refused with a message."""
    import jax

    from resformer_jax.analysis import measures
    from resformer_jax.analysis.per_layer import analysis_sequences, analyze_run, layer_tensors
    from resformer_jax.commands.training import run
    from resformer_jax.config import ConfigError
    from resformer_jax.load import load_run
    from resformer_jax.model import Transformer
    from resformer_jax.presets import tiny_config

    c = tiny_config("resformer")
    c.train.steps, c.train.warmup_steps, c.mesh.num_devices = 3, 1, 1
    wd = str(tmp_path / "run")
    assert run(c, wd) == 0
    res = analyze_run(wd, None, None, num_sequences=6, batch=4)["layers"]
    cfg, params, _ = load_run(wd, attention_impl="reference")
    seqs = analysis_sequences(cfg, "train", 6, 4)
    model = Transformer(for_backend(ModelConfig.of(cfg.model)), capture=True)
    fwd = jax.jit(lambda t: model.apply({"params": params}, t, mutable=["intermediates"])[1]["intermediates"])
    values, entropy = [[] for _ in range(3)], [[] for _ in range(3)]
    for b in range(0, 6, 4):
        chunk = np.stack(seqs[b : b + 4])[:, :-1]
        t = layer_tensors(jax.device_get(fwd(chunk)), 3)
        for n in range(3):
            for r in range(len(chunk)):
                v = t["values_own"][n][r]
                values[n].append(v.reshape(len(v), -1))
                entropy[n].append(measures.token_importance_entropy(t["attn_probs"][n][r]))
    for n in range(3):
        np.testing.assert_allclose(res["spectrum"][n], measures.mean_spectrum(values[n]), rtol=1e-10, atol=1e-12)
        assert res["largest_eigenvalue"][n] == pytest.approx(res["spectrum"][n][0])
        assert res["entropy"][n] == pytest.approx(float(np.mean(entropy[n])), rel=1e-12)
    c2 = tiny_config("resformer")
    c2.model.mapping = "cross_layer"
    with pytest.raises(ConfigError, match="cross_layer"):
        from resformer_jax.analysis.per_layer import check_analyzable

        check_analyzable(c2.model)


def test_text_file_documents_are_encoded_one_by_one_with_bos_first(tmp_path):
    """Attention-sink measures depend on the first token: each line is its own sample, BOS first, truncated at the
    sequence length (short lines left out); --text_unit=stream keeps one stream cut into windows."""
    import json as json_

    from hf_models import write_tiny_llama

    from resformer_jax.analysis.per_layer import hf_sequences

    write_tiny_llama(str(tmp_path / "m"), extra={"bos_token_id": 7})
    text = tmp_path / "t.txt"
    text.write_text(
        "short\n"
        + "The quick brown fox jumps over the lazy dog again and again. " * 4
        + "\n"
        + "def main():    return 42 and more code here to be long enough " * 4
        + "\n"
    )
    seqs = hf_sequences(str(tmp_path / "m"), str(text), seq_len=16, num_sequences=10)
    assert len(seqs) == 2 and all(s[0] == 7 and len(s) == 17 for s in seqs)
    stream = hf_sequences(str(tmp_path / "m"), str(text), seq_len=16, num_sequences=10, text_unit="stream")
    assert len(stream) >= 2 and not all(s[0] == 7 for s in stream)
    assert json_.load(open(tmp_path / "m" / "config.json"))["bos_token_id"] == 7


def test_the_committed_lm_eval_task_files_are_what_the_writer_writes(tmp_path):
    """configs/lm_eval_tasks/ (README's `--include_path`) is `resformer lm_eval_tasks`' output for
    ../shared/data/eval_samples, byte for byte: the YAMLs and the helper module they name, a copy of
    resformer_jax/eval/lm_eval_task_helpers.py (a change to either shows here)."""
    import pathlib

    from resformer_jax.eval.lm_eval_tasks import write_tasks

    root = pathlib.Path(__file__).resolve().parents[2]
    written = write_tasks("../shared/data/eval_samples", str(tmp_path))
    names = sorted(pathlib.Path(p).name for p in written) + ["resformer_local_tasks.py"]
    assert len(names) == 7
    for name in names:
        assert (tmp_path / name).read_bytes() == (root / "configs" / "lm_eval_tasks" / name).read_bytes(), (
            f"configs/lm_eval_tasks/{name} differs from what write_tasks writes: rerun `resformer lm_eval_tasks "
            "--task_data=../shared/data/eval_samples --out=configs/lm_eval_tasks`"
        )
