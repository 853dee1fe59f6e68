"""The engine's compiled half, apart from its scheduler (as vLLM's model runner is): the parameters as it serves
them (`serving_params`; the config is resolve.serving_model's), the backend's step form, the cache pools and the
two programs (a step over the paged cache; k decode steps read back once), jitted once per shape with the cache
donated and, on a mesh, run per shard. `engine.py` schedules requests and lays out each step's rows; `compile` and
`bench` import this module for the programs alone.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from resformer_jax.engine.errors import EngineError
from resformer_jax.engine.sampling import SamplingRows, sample_rows
from resformer_jax.kernels import paged_attention
from resformer_jax.kernels.names import target_backend
from resformer_jax.model.attention import PageLayout
from resformer_jax.model.config import ModelConfig
from resformer_jax.model.transformer import Transformer, lm_head_logits, pool_shapes, unrolled_params


@struct.dataclass
class StepRows:
    """A step's rows: the tokens fed [B, T] at their positions (-1: a padding slot, nothing written), each row's
    pages [B, P], and which of its tokens is its last (the LM head's) [B]."""

    tokens_BxT: Any
    positions_BxT: Any
    table_BxP: Any
    last_B: Any

    @classmethod
    def shapes(cls, B: int, T: int, P: int) -> StepRows:
        S, i32 = jax.ShapeDtypeStruct, jnp.int32
        return cls(S((B, T), i32), S((B, T), i32), S((B, P), i32), S((B,), i32))


@struct.dataclass
class ScoredRows:
    """The scored form's more: the token after each one fed [B, T] and the hidden state before the first [B, E]
    (a cached prefix's last)."""

    targets_BxT: Any
    carry_BxE: Any


@struct.dataclass
class DecodeRows:
    """A multi-step decode's rows: each row's one token fed [B] at its position (-1: padding), its pages [B, P],
    and how many of the k steps it runs [B]."""

    token_B: Any
    positions_B: Any
    table_BxP: Any
    steps_B: Any


class ModelRunner:
    """One model's parameters and paged cache on this host's default device, or on every device of `mesh` (the
    cache's pages split over all its axes, each device running its rows over its own pages with `shard_map`; the
    parameters replicated, or left as they come: sharded as in training, XLA gathers them into each step). `m` is
    the serving config (resolve.serving_model); `num_pages` a shard's pages."""

    def __init__(self, m: ModelConfig, params, num_pages: int, page_size: int, mesh: Mesh | None = None):
        self.model_cfg, self.mesh = m, mesh
        self.shards = 1 if mesh is None else int(mesh.devices.size)
        self.layout = PageLayout(num_pages, page_size)  # a shard's pages: the model runs per shard
        self.model = Transformer(m, pages=self.layout)
        self.form = step_form(m)
        self.params = serving_params(m, params, self.form.vocab_multiple)
        pools = init_pools(Transformer(m, pages=PageLayout(self.shards * num_pages, page_size)))
        # the parameters on the device once: host arrays (an export's numpy) would be copied into every step
        if mesh is None:
            self.cache = pools
            self.params = jax.device_put(self.params)
        else:
            split = _pages_split(m, mesh)
            self.cache = jax.device_put(pools, NamedSharding(mesh, split))
            leaves = jax.tree.leaves(self.params)
            if all(not isinstance(x, jax.Array) or x.sharding.is_fully_replicated for x in leaves):
                self.params = jax.device_put(self.params, NamedSharding(mesh, P()))
        self._step_fns: dict[int, Any] = {}  # top: the jitted step_program, made when first run
        self._decode_fns: dict[tuple[int, int], Any] = {}  # (k steps a readback, top)
        self.cache_bytes = int(sum(x.nbytes for x in jax.tree.leaves(self.cache)))  # every shard's together
        # every program run so far, keyed as jit keys its compiles (the arguments' tree, shapes and dtypes): a
        # key met for the first time is a compile (or a persistent-cache load, or one an engine of this model made)
        self.programs: set[tuple] = set()

    def _count(self, kind: tuple, *args) -> None:
        leaves, tree = jax.tree.flatten(args)
        self.programs.add((kind, tree, tuple((np.shape(x), np.asarray(x).dtype.str) for x in leaves)))

    def _step_fn(self, top: int) -> Any:
        if top not in self._step_fns:  # jitted once a form; traced again for penalties or masks (another pytree)
            self._step_fns[top] = _jitted(self.model, self.mesh, self.form.compiler_options, ("step", top))
        return self._step_fns[top]

    def _decode_fn(self, k: int, top: int) -> Any:
        if (k, top) not in self._decode_fns:
            self._decode_fns[k, top] = _jitted(self.model, self.mesh, self.form.compiler_options, ("decode", k, top))
        return self._decode_fns[k, top]

    def step(
        self,
        top: int,
        rows: StepRows,
        sampling: SamplingRows,
        scored: ScoredRows | None = None,
    ):
        """step_program(top) over the step's rows; the cache replaced by the updated one. Returns the
        outputs before the cache."""
        fn = self._step_fn(top)
        self._count(("step", top), rows, sampling, scored)
        *out, self.cache = fn(self.params, self.cache, rows, sampling, scored)
        return out

    def decode(self, k: int, top: int, rows: DecodeRows, sampling: SamplingRows):
        """decode_program(k, top) over the rows; as `step`."""
        fn = self._decode_fn(k, top)
        self._count(("decode", k, top), rows, sampling)
        *out, self.cache = fn(self.params, self.cache, rows, sampling)
        return out

    def warm(self, rows: StepRows | DecodeRows, sampling: SamplingRows, k: int = 1) -> None:
        """Compiles the program `step(0, rows, sampling)` (StepRows) or `decode(k, 0, rows, sampling)` would run
        and runs it once on `rows`, padding rows (position -1: they write page 0 alone, no sequence's): a
        program's first run costs a one-off 10-40x its later runs on XLA:CPU (docs/evaluation.md), paid here."""
        out = self.step(0, rows, sampling) if isinstance(rows, StepRows) else self.decode(k, 0, rows, sampling)
        jax.block_until_ready(out)


def _pages_split(m: ModelConfig, mesh: Mesh) -> P:
    """A pool's spec on `mesh`: its pages split over every axis, each device its rows' pages."""
    kernel = paged_attention.kernel_for(m.attention_impl, m.head_dim)
    return P(*[None] * paged_attention.pages_axis(kernel), mesh.axis_names)


@functools.lru_cache(maxsize=32)
def _jitted(model: Transformer, mesh: Mesh | None, options: tuple, program: tuple) -> Any:
    """`program` ("step", top) or ("decode", k, top) of `model`, jitted with the cache donated (on a mesh, per
    shard). Made once per (model, mesh, program) in a process: engines of one model share its traces and compiles
    (an engine rebuilt over the same model, `bench` and `compile` beside `serve`)."""
    fn, groups, scored = (
        (step_program(model, program[1]), 3, 4 if program[1] else 0)
        if program[0] == "step"
        else (decode_program(model, program[1], program[2]), 2, 3 if program[2] else 0)
    )
    if mesh is not None:  # after (params, cache): typed row groups, each group's every leaf split by rows
        row_spec = P(mesh.axis_names)
        cache_spec = jax.tree.map(lambda _: _pages_split(model.cfg, mesh), pool_shapes(model))
        in_specs = (P(), cache_spec) + (row_spec,) * groups
        scores = ((row_spec,) * scored,) if scored else ()
        out_specs = (row_spec, row_spec, *scores, cache_spec)
        fn = jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, check_vma=False)
    return jax.jit(fn, donate_argnums=(1,), compiler_options=dict(options))


def engine_mesh(devices: int) -> Mesh | None:
    """The mesh an engine on `devices` devices runs on (-1: every device; 1: none, the default device)."""
    have = jax.devices()
    n = len(have) if devices == -1 else devices
    if n < 1 or n > len(have):
        choices = "1" if len(have) == 1 else f"1 to {len(have)}"
        raise EngineError(
            f"--devices={devices}: this host has {len(have)} device{'s' if len(have) > 1 else ''}; give {choices}, "
            "or -1 (every device)"
        )
    return None if n == 1 else Mesh(np.asarray(have[:n]), ("data",))


@dataclasses.dataclass(frozen=True)
class StepForm:
    """How the engine's programs are shaped for the backend they run on, resolved once (`step_form`)."""

    min_rows: int = 1  # rows a step runs at least (a padding row attends over nothing and writes nothing)
    vocab_multiple: int = 1  # the LM head's columns held padded with zeros to a multiple of this, cut after
    compiler_options: tuple[tuple[str, Any], ...] = ()  # XLA options for every program the engine compiles
    # one page-table width (a full context's) for every one-token step: its cost does not grow with the width
    # there, so no compile per page bucket (a CPU's paged kernels read each row's pages up to its length)
    decode_table_full: bool = False


def step_form(m: ModelConfig | None = None) -> StepForm:
    """The form for the backend the engine is traced for (kernels.names.target_backend). A GPU (read off the
    compiled 468M step, docs/kernels-and-compile.md): two rows at least, as XLA:GPU makes a one-row matmul an
    elementwise product and a reduction (2.7x the weight's bytes); the LM head padded once to 128 columns, which
    XLA would pad with a copy of the weight every step; and no dot merger, which concatenates each MLP's gate and
    up weights into one operand every step (a training step amortizes that copy over its tokens, a decode step
    cannot). A CPU: one-token steps read each row's pages in place up to its length (a native kernel, or XLA's loop
    over blocks of pages), so one table width serves them all, except Eq. 2's cross-layer mapping (`m`), whose
    one-token steps gather every page the table holds."""
    if target_backend() == "gpu":
        return StepForm(min_rows=2, vocab_multiple=128, compiler_options=(("xla_gpu_dot_merger_threshold_mb", 0),))
    if target_backend() == "cpu":
        return StepForm(decode_table_full=m is not None and m.mapping != "cross_layer")
    return StepForm()


def serving_params(m: ModelConfig, params, vocab_multiple: int = 1):
    """The parameters as the engine holds them (m from resolve.serving_model): unrolled (a layer each), and where the
    compute dtype is narrower than float32 rounded to it once (training keeps float32 masters; a decode step that
    cast them each time would read 4 bytes a weight and write 2 before its matmuls read them: decode is bound by
    those bytes): stored in it, or for the "rounded" matmuls as its values in float32. An untied LM head's columns
    padded with zeros to a multiple of vocab_multiple (StepForm)."""
    params = nn.unbox(params)
    params = unrolled_params(params, m.num_layers) if "layers" in params else params
    pad = -m.vocab_size % vocab_multiple
    if pad and "lm_head" in params:
        kernel = params["lm_head"]["kernel"]
        params = {**params, "lm_head": {**params["lm_head"], "kernel": jnp.pad(kernel, ((0, 0), (0, pad)))}}
    if m.dtype in ("bfloat16", "float16"):
        narrow = jnp.dtype(m.dtype)
        to = (lambda x: x.astype(narrow).astype(x.dtype)) if m.matmuls == "rounded" else (lambda x: x.astype(narrow))
        params = jax.tree.map(lambda x: to(x) if jnp.issubdtype(x.dtype, jnp.floating) else x, params)
    return params


def step_program(model: Transformer, top: int = 0):
    """The engine's one program as a pure function of (params, cache, rows: StepRows, sampling: SamplingRows,
    scored: ScoredRows | None): the paged model over the rows' tokens, the LM head at
    each row's last token, per-row sampling. Returns (token_B, logprob_B, the updated cache). Engine jits it with
    the cache donated; `resformer compile --steps=decode` compiles it for a target.

    With `top` (the scored form, given ScoredRows): the LM head at the carried state and at every position, and
    after the sampled tokens, per row: log p of tokens_BxT[:, 0] then of the targets [B, T + 1], the `top` most
    likely ids and their log-probabilities there [B, T + 1, top], and the hidden states [B, T, E] (a page's last
    is kept with its block): a prompt's log-probabilities read in its prefill."""
    forward = _forward(model, top)

    def program(params, cache, rows: StepRows, sampling: SamplingRows, scored: ScoredRows | None):
        return forward(params, cache, rows, sampling.counted(model.cfg.vocab_size), scored)

    return program


def _forward(model: Transformer, top: int):
    """step_program with the sampling rows counted (SamplingRows.counted)."""
    m = model.cfg

    def forward(params, cache, rows: StepRows, sampling: SamplingRows, scored: ScoredRows | None):
        h_BxTxE, mutated = model.apply(
            {"params": params, "cache": cache},
            rows.tokens_BxT,
            rows.positions_BxT,
            return_hidden=True,
            page_table_BxP=rows.table_BxP,
            mutable=["cache"],
        )
        h_BxE = jnp.take_along_axis(h_BxTxE, rows.last_B[:, None, None], axis=1)
        # the LM head as held (serving_params may pad its columns), the padding's logits cut
        width = params["lm_head"]["kernel"].shape[-1] if "lm_head" in params else m.vocab_size
        head = lambda h: lm_head_logits(m.replace(vocab_size=width), params, h)[..., : m.vocab_size]
        token_B, logprob_B = sample_rows(head(h_BxE)[:, 0], sampling)
        if not top:
            return token_B, logprob_B, mutated["cache"]
        assert scored is not None, "the scored form reads ScoredRows"
        h_BxT1xE = jnp.concatenate([scored.carry_BxE[:, None].astype(h_BxTxE.dtype), h_BxTxE], axis=1)
        targets_BxT1 = jnp.concatenate([rows.tokens_BxT[:, :1], scored.targets_BxT], axis=1)
        logp_BxT1xV = jax.nn.log_softmax(head(h_BxT1xE).astype(jnp.float32), axis=-1)
        chosen_BxT1 = jnp.take_along_axis(logp_BxT1xV, targets_BxT1[..., None], axis=-1)[..., 0]
        top_lp_BxT1xN, top_id_BxT1xN = jax.lax.top_k(logp_BxT1xV, top)
        return token_B, logprob_B, (chosen_BxT1, top_id_BxT1xN, top_lp_BxT1xN, h_BxTxE), mutated["cache"]

    return forward


def decode_program(model: Transformer, k: int, top: int = 0):
    """`k` decode steps as one program of (params, cache, rows: DecodeRows, sampling: SamplingRows), read back
    once (the host's work and the readback paid once for k tokens, not per token): each step feeds the token it
    sampled to the next, a row's K/V written at positions_B, positions_B + 1, ... Row b runs its first steps_B[b]
    steps (its pages reserved for them); after those, and on a padding row (position -1), nothing is written. The
    sampling rows follow each row's text (SamplingRows.after): a row's i-th token samples with its counter + i, as
    k single steps would, and its penalties' counts and masks take each token sampled before the next step
    samples. Returns (token_BxK, logprob_BxK, the updated cache); with `top`, before the cache, (None, the `top`
    most likely ids [B, K, top], their log-probabilities) at each step."""
    forward = _forward(model, top)

    def decode(params, cache, rows: DecodeRows, sampling: SamplingRows):
        B = rows.token_B.shape[0]
        last_B = jnp.zeros((B,), jnp.int32)

        def one(i, carry):
            cache, sampling, token_B, tokens_KxB, logprobs_KxB, ids_KxBxN, lps_KxBxN = carry
            live_B = (rows.positions_B >= 0) & (i < rows.steps_B)
            position_Bx1 = jnp.where(live_B, rows.positions_B + i, -1)[:, None]
            step = StepRows(token_B[:, None], position_Bx1, rows.table_BxP, last_B)
            scored = ScoredRows(token_B[:, None], jnp.zeros((B, model.cfg.d_model), jnp.float32)) if top else None
            out = forward(params, cache, step, sampling, scored)
            token_B, logprob_B, cache = out[0], out[1], out[-1]
            sampling = sampling.after(token_B, live_B)  # the token sampled joins the row's text
            if top:  # score 1: after the token fed (0 is the carried state's, unused here)
                ids_KxBxN, lps_KxBxN = ids_KxBxN.at[i].set(out[2][1][:, 1]), lps_KxBxN.at[i].set(out[2][2][:, 1])
            tokens_KxB, logprobs_KxB = tokens_KxB.at[i].set(token_B), logprobs_KxB.at[i].set(logprob_B)
            return cache, sampling, token_B, tokens_KxB, logprobs_KxB, ids_KxBxN, lps_KxBxN

        n = max(top, 1)
        tokens_KxB, logprobs_KxB = jnp.zeros((k, B), jnp.int32), jnp.zeros((k, B), jnp.float32)
        ids_KxBxN, lps_KxBxN = jnp.zeros((k, B, n), jnp.int32), jnp.zeros((k, B, n), jnp.float32)
        counted = sampling.counted(model.cfg.vocab_size)
        init = (cache, counted, rows.token_B, tokens_KxB, logprobs_KxB, ids_KxBxN, lps_KxBxN)
        cache, _, _, tokens_KxB, logprobs_KxB, ids_KxBxN, lps_KxBxN = jax.lax.fori_loop(0, k, one, init)
        if not top:
            return tokens_KxB.T, logprobs_KxB.T, cache
        scores = (logprobs_KxB.T, ids_KxBxN.transpose(1, 0, 2), lps_KxBxN.transpose(1, 0, 2))
        return tokens_KxB.T, logprobs_KxB.T, scores, cache

    return decode


def step_shapes(model: Transformer, rows: int, tokens: int, pages_per_row: int) -> tuple:
    """step_program's arguments after (params, cache), as shapes: `rows` sequences of `tokens` new tokens each,
    `pages_per_row` pages in each row's table; no penalties, not scored."""
    return StepRows.shapes(rows, tokens, pages_per_row), SamplingRows.shapes(rows), None


def init_pools(model: Transformer):
    """Zeroed cache pools of a paged model."""
    return jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), pool_shapes(model))


def free_memory_bytes() -> float:
    """The default device's free memory (a CPU: the host's available memory)."""
    stats = jax.devices()[0].memory_stats() or {}
    if "bytes_limit" in stats:
        return float(stats["bytes_limit"] - stats.get("bytes_in_use", 0))
    import psutil

    return float(psutil.virtual_memory().available)
