"""Packed documents (data.document_mask): a sequence holding several documents, each ended by the end-of-text
token, gives each document's logits and gradients as if it were run alone (positions restarted), through every
attention kernel (the GPU and TPU ones interpreted), every value-residual mode and GQA; runs without it are
unchanged; bad settings are named."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from commands import run_command
from tiers import fast_few

from resformer_jax import kernels
from resformer_jax.config import ConfigError, validate
from resformer_jax.kernels import attention as dispatch
from resformer_jax.kernels import names
from resformer_jax.model import Transformer
from resformer_jax.model.config import ModelConfig
from resformer_jax.model.transformer import attended_fraction, document_segments
from resformer_jax.presets import tiny_config
from resformer_jax.resolve import for_backend

EOT = 7
LENGTHS = (9, 14, 17)  # three documents packed into one sequence of 40 tokens


def packed(rng, vocab):
    """One packed row: documents of LENGTHS (each but the last ended by EOT), and each document alone."""
    docs = []
    for n in LENGTHS:
        d = rng.integers(EOT + 1, vocab, size=n)
        docs.append(d)
    for d in docs[:-1]:
        d[-1] = EOT
    return np.concatenate(docs)[None], [d[None] for d in docs]


def test_segments_and_positions_restart_after_each_end_of_text():
    tokens = jnp.asarray([[3, 4, EOT, 5, EOT, 6, 6, 6], [EOT, 1, 2, 3, 4, 5, 6, 8]])
    seg, pos = document_segments(tokens, EOT)
    assert seg.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2], [0, 1, 1, 1, 1, 1, 1, 1]]
    assert pos.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2], [0, 0, 1, 2, 3, 4, 5, 6]]


def test_the_model_flops_count_the_attention_pairs_documents_keep():
    """Documents of LENGTHS keep sum L(L+1)/2 of a 40-token sequence's 40 x 41 / 2 causal pairs; the model FLOPs
    shrink by that share of attention's alone."""
    from resformer_jax.perf import attention_flops_per_token, model_flops

    row, _ = packed(np.random.default_rng(0), 50)
    kept = sum(n * (n + 1) / 2 for n in LENGTHS) / (40 * 41 / 2)
    tokens = jnp.asarray(np.concatenate([row, np.full((1, 40), 9)]))  # a second row: one document
    assert float(attended_fraction(tokens, EOT)) == pytest.approx((kept + 1) / 2)
    m = ModelConfig.of(tiny_config("resformer").model)
    whole = model_flops(m, 40)
    assert whole.attention_per_token == attention_flops_per_token(m, 40) > 0
    docs = whole.attending(kept)
    assert docs.per_token == pytest.approx(whole.per_token - (1 - kept) * whole.attention_per_token)
    assert docs.per_token_6n == whole.per_token_6n  # 6N counts no attention


@pytest.mark.parametrize("bq,bk", [(16, 16), (32, 16), (16, 32)])
def test_the_roofline_counts_the_blocks_the_pallas_kernels_skip_on_documents(bq, bk):
    """One document a row: every causal block, as without documents. Documents of 64 tokens (whole blocks): each
    document's own causal blocks and none across, forward, dQ and dK/dV alike. Geometric documents: between."""
    from resformer_jax.kernels.pallas_attention import visited_blocks, visited_blocks_documents
    from resformer_jax.perf import packed_documents

    T = 256
    one = np.zeros((3, T), np.int32)
    aligned = np.zeros((2, T), np.int32)
    aligned[:, 63::64] = 1
    for dkdv in (False, True):
        assert visited_blocks_documents(one, T, bq, bk, dkdv) == visited_blocks(T, T, bq, bk)
        assert visited_blocks_documents(aligned, T, bq, bk, dkdv) == 4 * visited_blocks(64, 64, bq, bk)
    geometric = visited_blocks_documents(packed_documents(T, 48), T, bq, bk, False)
    assert 4 * visited_blocks(64, 64, bq, bk) < geometric < visited_blocks(T, T, bq, bk)


def _forward_and_grad(m):
    """The model's logits and the gradient of their sum, each one compiled program (eager: an op at a time)."""
    forward = jax.jit(lambda p, tokens: Transformer(m).apply({"params": p}, tokens))
    return forward, jax.jit(jax.grad(lambda p, tokens: forward(p, tokens).sum()))


CASES = [
    ("none", {}, "reference"),
    ("resformer", {}, "xla"),
    ("svformer", {}, "chunked"),
    ("skipv1", {"num_kv_heads": 2}, "chunked"),
    ("resformer", {"num_kv_heads": 2}, "pallas"),
    ("none", {"value_embeddings": 1}, "xla"),
    ("resformer", {"resformer_lambdas": "gated"}, "chunked"),
]


@pytest.mark.slow  # 6-12 s a case on 2 cores, cold; the fast tier's documents tests are below
@pytest.mark.parametrize(
    "variant,fields,impl",
    CASES,
    ids=[f"{v}-{i}-{'+'.join(f)}" for v, f, i in CASES],
)
def test_a_packed_sequence_is_its_documents_run_alone(variant, fields, impl):
    """Logits of each document's tokens, and the gradient of every parameter, equal (to fp32 precision) those of
    the documents run one at a time with their positions from 0: nothing crosses a document boundary, and V_1
    of a token is its own in every variant."""
    c = tiny_config(variant)
    c.model.update(dtype="float32", attention_impl=impl, document_eot=EOT, scan_layers=False, **fields)
    m = for_backend(ModelConfig.of(c.model))
    rng = np.random.default_rng(0)
    row, docs = packed(rng, m.vocab_size)
    params = nn.unbox(Transformer(m).init(jax.random.PRNGKey(1), jnp.asarray(row))["params"])
    forward, grad = _forward_and_grad(m)
    logits = np.asarray(forward(params, jnp.asarray(row)))[0]
    forward_alone, grad_alone = _forward_and_grad(m.replace(document_eot=-1))
    start = 0
    for d in docs:
        want = np.asarray(forward_alone(params, jnp.asarray(d)))[0]
        np.testing.assert_allclose(logits[start : start + d.shape[1]], want, rtol=2e-4, atol=2e-4)
        start += d.shape[1]
    g_packed = grad(params, jnp.asarray(row))
    g_alone = jax.tree.map(lambda *g: sum(g), *[grad_alone(params, jnp.asarray(d)) for d in docs])
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(g_packed), jax.tree.leaves(g_alone)):
        np.testing.assert_allclose(a, b, rtol=2e-3, atol=2e-4, err_msg=jax.tree_util.keystr(path))


def test_without_the_mask_the_documents_see_each_other_and_runs_are_as_before():
    """Off (the default): one sequence, as the paper trains: the second document's logits depend on the first."""
    c = tiny_config("resformer")
    c.model.dtype = "float32"
    m = for_backend(ModelConfig.of(c.model))
    assert m.document_eot == -1
    row, docs = packed(np.random.default_rng(0), m.vocab_size)
    params = nn.unbox(Transformer(m).init(jax.random.PRNGKey(1), jnp.asarray(row))["params"])
    forward, _ = _forward_and_grad(m)
    logits = np.asarray(forward(params, jnp.asarray(row)))[0]
    second = np.asarray(forward(params, jnp.asarray(docs[1])))[0]
    assert not np.allclose(logits[LENGTHS[0] : LENGTHS[0] + LENGTHS[1]], second, atol=1e-3)


@pytest.mark.slow
def test_splash_masks_documents_interpreted():
    """The TPU kernel (splash, interpreted here) with segment ids against the reference, forward and gradients."""
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=(1, 256, n, 128)), jnp.float32) for n in (2, 1, 1))
    seg = jnp.asarray(np.repeat([0, 1, 2], [100, 100, 56])[None], jnp.int32)

    def f(impl):
        return lambda q, k, v: dispatch.attention(q, k, v, impl=impl, segments_BxT=seg)

    np.testing.assert_allclose(f("splash")(q, k, v), f("reference")(q, k, v), atol=1e-5)
    loss = lambda impl: lambda *a: (f(impl)(*a) ** 2).sum()
    for a, b in zip(jax.grad(loss("splash"), (0, 1, 2))(q, k, v), jax.grad(loss("reference"), (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(a, b, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("block", fast_few([8, 16], [8]))
def test_pallas_skips_blocks_outside_a_blocks_documents_and_stays_exact(block):
    """The GPU kernel (interpreted) with blocks smaller than a document: the key blocks before a query block's
    first document are skipped (forward and dQ), the query blocks after a key block's last document too (dK/dV);
    outputs and gradients equal the reference's, GQA included."""
    from resformer_jax.kernels.pallas_attention import flash_attention

    rng = np.random.default_rng(1)
    q = jnp.asarray(rng.normal(size=(2, 40, 4, 8)), jnp.float32)
    k, v = (jnp.asarray(rng.normal(size=(2, 40, 2, 8)), jnp.float32) for _ in range(2))
    seg = jnp.asarray(np.stack([np.repeat([0, 1, 2], [10, 17, 13]), np.repeat([0, 1], [33, 7])]), jnp.int32)
    ref = lambda *a: dispatch.attention(*a, impl="reference", segments_BxT=seg)
    got = lambda *a: flash_attention(*a, segments_BxT=seg, block_q=block, block_k=block)
    np.testing.assert_allclose(got(q, k, v), ref(q, k, v), atol=1e-5)
    sq = lambda f: lambda *a: (f(*a) ** 2).sum()
    for a, b in zip(jax.grad(sq(got), (0, 1, 2))(q, k, v), jax.grad(sq(ref), (0, 1, 2))(q, k, v)):
        np.testing.assert_allclose(a, b, atol=2e-5, rtol=1e-5)


def test_bad_settings_are_named():
    c = tiny_config("resformer")
    c.data.document_mask = True  # synthetic data: no end-of-text token unless given
    with pytest.raises(ConfigError, match="data.eot_id"):
        validate(c)
    c.data.eot_id = EOT
    validate(c)
    c.model.attention_impl = "cudnn"
    with pytest.raises(ConfigError, match="attention_impl=pallas"):
        validate(c)
    with pytest.raises(kernels.KernelUnavailable, match="cannot mask documents"):
        q = jnp.zeros((1, 8, 2, 8))
        dispatch.attention(q, q, q, impl="cudnn", segments_BxT=jnp.zeros((1, 8), jnp.int32))
    candidates, rejected = names.auto_candidates("gpu", documents=True)
    assert "cudnn" not in candidates and "document mask" in rejected["cudnn"]


@pytest.mark.slow  # 8-10 s cold on 2 cores either way
@pytest.mark.parametrize("chunk_len", [8, 0])
def test_a_packed_batchs_loss_is_the_documents_loss_run_separately(chunk_len):
    """document_start_loss=False: the target after each end-of-text token is left out and the mean is over the rest,
    so a packed row's loss is the token-weighted mean of its documents' losses run alone (fused and full-logits
    heads alike)."""
    from resformer_jax.train.step import lm_loss

    c = tiny_config("svformer")
    c.model.update(dtype="float32", attention_impl="chunked", document_eot=EOT)
    m = for_backend(ModelConfig.of(c.model))
    row, docs = packed(np.random.default_rng(3), m.vocab_size)
    model, alone = Transformer(m), Transformer(m.replace(document_eot=-1))
    params = nn.unbox(model.init(jax.random.PRNGKey(1), jnp.asarray(row))["params"])
    got = lm_loss(params, model, jnp.asarray(row), chunk_len, document_starts=False)[0]
    each = [float(lm_loss(params, alone, jnp.asarray(d), chunk_len)[0]) for d in docs]
    want = sum(e * (n - 1) for e, n in zip(each, LENGTHS)) / sum(n - 1 for n in LENGTHS)
    assert float(got) == pytest.approx(want, rel=1e-5)
    counted = lm_loss(params, model, jnp.asarray(row), chunk_len)[0]  # the default counts the crossing targets
    assert float(counted) != pytest.approx(want, rel=1e-4)


def test_the_eval_step_counts_the_targets_its_mean_is_over():
    """make_eval_step gives (mean, targets counted): end-of-text crossings and rows outside rows_B left out, so a
    split's loss weighted by the counts is the mean over every target kept, whatever the batches."""
    from resformer_jax.train.step import make_eval_step

    c = tiny_config("resformer")
    c.model.update(dtype="float32", attention_impl="chunked", document_eot=EOT)
    m = for_backend(ModelConfig.of(c.model))
    rows = np.concatenate([packed(np.random.default_rng(s), m.vocab_size)[0] for s in range(3)])
    rows[1, 3] = EOT  # another crossing: the rows count differently
    model = Transformer(m)
    params = nn.unbox(model.init(jax.random.PRNGKey(1), jnp.asarray(rows))["params"])
    step = jax.jit(make_eval_step(model, 8, document_starts=False))
    logits = jax.jit(model.apply)({"params": params}, jnp.asarray(rows[:, :-1]))
    nll = -jnp.take_along_axis(jax.nn.log_softmax(logits, -1), jnp.asarray(rows[:, 1:, None]), -1)[..., 0]
    kept = rows[:, :-1] != EOT
    for rows_B in (np.array([True, True, True]), np.array([True, False, True])):
        loss, counted = step(params, jnp.asarray(rows), jnp.asarray(rows_B))
        mask = kept & rows_B[:, None]
        assert int(counted) == int(mask.sum()) and int(counted) < rows[:, 1:].size
        assert float(loss) == pytest.approx(float(jnp.sum(nll * mask) / mask.sum()), rel=1e-5)


@pytest.mark.slow
def test_a_run_with_document_masking_trains_records_its_token_and_resumes(tmp_path):
    """data.document_mask on a run: the end-of-text token is resolved into the run's record (model.document_eot),
    the loss falls, and the run resumes with it."""
    import json

    from resformer_jax.commands.training import run
    from resformer_jax.config import RunConfig
    from resformer_jax.data.pipeline import validation_sets

    c = tiny_config("resformer")
    c.data.update(document_mask=True, eot_id=EOT, document_start_loss=False)
    # an end-of-text id the validation batch holds (synthetic tokens are uniform): its targets are left out
    batch = validation_sets(RunConfig.of(c), c.train.global_batch, 1)["synthetic"][0]
    c.data.eot_id = eot = int(np.bincount(batch[:, :-1].ravel()).argmax())
    c.train.update(steps=8, log_every=2, eval_every=4)
    c.checkpoint.every_steps = 4
    c.mesh.num_devices = 1
    wd = str(tmp_path / "run")
    assert run(c, wd) == 0
    record = json.loads((tmp_path / "run" / "config.json").read_text())
    assert record["resolved"]["model.document_eot"] == eot and record["data"]["document_mask"] is True
    c.train.steps = 12
    assert run(c, wd) == 0
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = sorted({r["step"] for r in rows if "train/loss" in r})
    assert steps[-1] == 12
    kept = [r["perf/attended_fraction"] for r in rows if "train/loss" in r]  # the MFU counts the pairs kept
    assert len(kept) == len(steps) and all(0 < k <= 1 for k in kept) and min(kept) < 1, kept
    # `resformer evaluate`'s validation is the loop's: document_start_loss=False leaves the same targets out
    r = run_command("evaluate", f"--workdir={wd}", f"--batch={c.train.global_batch}")  # in-process
    assert r.returncode == 0, r.stderr[-2000:]
    table = json.loads((tmp_path / "run" / "eval" / "validation_step12.json").read_text())["loss"]
    last = [r for r in rows if "eval/loss" in r][-1]
    assert last["step"] == 12 and table["synthetic"] == pytest.approx(last["eval/synthetic/loss"], abs=1e-6)
