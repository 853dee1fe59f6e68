"""Every step compiled for real accelerators from this CPU machine: not only lowered, compiled by the
target's own compiler, without the hardware.

TPU: libtpu compiles for a topology of chips (`jax.experimental.topologies`): Mosaic compiles the splash kernel,
XLA assigns HBM and refuses a program over it. GPU: with JAX_PLATFORMS=cpu, the CUDA plugin compiles for
compile-only H100s described by the shipped target config (resformer_jax/compilation/gpu_specs/h100_sxm.txtpb): Triton
compiles the Pallas kernel to GPU machine code (the executable carries ELF images), enforcing the GPU's shared
memory. These tests need `pip install -e '.[aot]'` (CI installs it); without it they skip saying so.

What cannot be compiled here: cuDNN's attention (jax asks the local CUDA runtime for the cuDNN version while
tracing, before any compiler runs; see the last tests) and autotuning (no device to time on), so nothing here
says how fast a step is: `resformer bench accelerator` does on a real device.
"""

import contextlib
import importlib.util
import json
import os

import jax
import jax.numpy as jnp
import pytest
from commands import run_command
from compile_targets import MOSAIC, TARGETS, TRITON, accelerator_config, needs_aot

from resformer_jax import kernels
from resformer_jax.kernels import names, probe
from resformer_jax.presets import tiny_config
from resformer_jax.resolve import resolve
from resformer_jax.train.setup import build

pytestmark = pytest.mark.slow  # end-to-end: runs, commands, processes or compilers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@needs_aot
@pytest.mark.parametrize("platform", ["cuda", "tpu"])
@pytest.mark.parametrize("variant", ["none", "resformer", "svformer"])
def test_sharded_train_eval_and_decode_steps_compile_for_the_target(platform, variant, tmp_path):
    from resformer_jax.compilation.aot import compile_for_target
    from resformer_jax.compilation.targets import parse_target

    target = parse_target(TARGETS[platform])
    # decode for SVFormer, whose cache differs most (no V cache past layer 1), on a TPU here; on H100s in the engine's
    # test below (the same checks, at its batch and context)
    steps = ("train", "eval", "decode") if (variant, platform) == ("svformer", "tpu") else ("train", "eval")
    with _persistent_cache_in(tmp_path / "jax_cache") as written:
        report = compile_for_target(accelerator_config(variant, platform), target, steps=steps, log=lambda s: None)
        # a compile-only client's programs cannot be read back, so none is written; this process's own still are
        assert not any(f.startswith(("jit_train_step", "jit_eval_step")) for f in written()), written()
        jax.jit(lambda x: x * 3 + 1)(jnp.arange(5.0)).block_until_ready()
        assert any(f.startswith("jit__lambda") for f in written()), written()
    assert report.attention_impl == {"cuda": "pallas", "tpu": "splash"}[platform]
    assert report.mesh == {"data": 2, "fsdp": target.num_devices // 2, "context": 1} and report.dtype == "bfloat16"
    by = {s.name: s for s in report.steps}
    assert set(by) == ({"train", "eval", "decode_prefill", "decode_token"} if "decode" in steps else {"train", "eval"})
    kernel = TRITON if platform == "cuda" else MOSAIC
    # forward and backward of every layer's attention go through the platform's kernel, compiled
    assert by["train"].custom_calls.get(kernel, 0) >= 2, by["train"].custom_calls
    assert by["eval"].custom_calls.get(kernel, 0) >= 1, by["eval"].custom_calls
    for s in report.steps:
        assert s.fits and s.memory is not None and 0 < s.memory.total < target.hbm_bytes, s
        if platform == "cuda":
            assert "GPU ELF image" in s.machine_code and not s.machine_code.startswith("0 "), s.machine_code
        else:
            assert "TPU executable" in s.machine_code
    # the state is sharded over fsdp: each device holds about a (fsdp)th of the parameters + AdamW moments
    fsdp = report.mesh["fsdp"]
    assert by["train"].memory.arguments < 16 * 1.6e6 / fsdp * 1.6, by["train"].memory
    line = json.dumps(report.to_json())
    assert '"fits": true' in line
    if (variant, platform) == ("resformer", "cuda"):  # one optimizer beside AdamW is enough: its state's layout
        _muon_state_is_sharded_over_fsdp_and_smaller_than_adamws(target, by["train"].memory.arguments)


@contextlib.contextmanager
def _persistent_cache_in(path):
    """JAX's persistent compilation cache on, in `path`, for the block (yields a lister of its entries); as it was
    after (a run with JAX_ENABLE_COMPILATION_CACHE=false, as the coverage command's, included)."""
    from jax.experimental.compilation_cache import compilation_cache

    was = jax.config.jax_compilation_cache_dir, jax.config.jax_enable_compilation_cache
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_enable_compilation_cache", True)
    compilation_cache.reset_cache()
    try:
        yield lambda: sorted(os.listdir(path)) if os.path.isdir(path) else []
    finally:
        jax.config.update("jax_compilation_cache_dir", was[0])
        jax.config.update("jax_enable_compilation_cache", was[1])
        compilation_cache.reset_cache()


def _muon_state_is_sharded_over_fsdp_and_smaller_than_adamws(target, adamw_arguments):
    """Muon keeps one moment per hidden matrix (AdamW two): its train step's arguments (parameters + optimizer state)
    per device are smaller, and sharded over fsdp like AdamW's."""
    from resformer_jax.compilation.aot import compile_for_target

    c = accelerator_config("resformer", "cuda")
    c.train.optimizer = "muon"
    (train,) = compile_for_target(c, target, steps=("train",), log=lambda s: None).steps
    assert train.fits, train
    assert train.memory.arguments < adamw_arguments, (train.memory.arguments, adamw_arguments)
    assert train.memory.arguments < 16 * 1.6e6 / (target.num_devices // 2) * 1.6, train.memory


@needs_aot
@pytest.mark.slow
def test_the_decode_engines_program_compiles_with_a_tokens_per_s_bound():
    """`compile --steps=decode` compiles the engine's own program (engine/runner.py step_program) for one device of
    the target: SVFormer's paged cache holds (L+1)/(2L) of vanilla's bytes for the same sequences, and the decode
    step reports its tokens/s bound (rows over the roofline bound). Its pages are read in place by JAX's Pallas
    paged_attention, compiled by Triton; with the scatter into the donated pools counted as its update alone, the
    bound stays near the bytes the step must read (the weights once, every layer's K and V or V_1)."""
    from resformer_jax.compilation.aot import compile_for_target
    from resformer_jax.compilation.targets import parse_target

    decode, weight_bytes = {}, {}
    for variant in ("none", "svformer"):
        report = compile_for_target(
            accelerator_config(variant, "cuda"),
            parse_target("h100x8"),
            steps=("decode",),
            decode_batch=8,
            prompt_len=200,
            log=lambda s: None,
        )
        (prefill, token) = report.steps
        assert (prefill.name, token.name) == ("decode_prefill", "decode_token") and prefill.fits and token.fits
        for s in report.steps:  # compiled to machine code, within an H100's memory
            assert s.memory is not None and 0 < s.memory.total < parse_target("h100x8").hbm_bytes, s
            assert "GPU ELF image" in s.machine_code and not s.machine_code.startswith("0 "), s.machine_code
        assert "Triton (Pallas)" in token.kernels, token.custom_calls  # the paged kernel, reading pages in place
        decode[variant] = token.to_json()["decode"]
        weight_bytes[variant] = token.memory.arguments - decode[variant]["kv_cache_bytes"]
        assert decode[variant]["rows"] == 8 and decode[variant]["context_tokens"] == 200
        assert decode[variant]["tokens_per_s_bound"] == pytest.approx(8 / token.roofline["per_op_bound_s"])
        assert any("tokens/s bound on one device" in line for line in report.lines())
    L = 3
    assert decode["svformer"]["kv_cache_bytes"] * 2 * L == decode["none"]["kv_cache_bytes"] * (L + 1)
    # the bytes the step must read: the weights once (bf16) and every layer's K and V, or K and V_1 (as many bytes
    # as vanilla's cache); the bound holds them at 1.4x for this small model (its LM head and norms weigh more
    # here); the gather path had been about 3x
    for variant, d in decode.items():
        must_read = weight_bytes[variant] + decode["none"]["kv_cache_bytes"]
        assert d["bound_s"] * 3.35e12 < 1.6 * must_read, (variant, d["bound_s"] * 3.35e12, must_read)


# The 468M model's attention per device (Table 4: 16 heads of 64; T = 2,048), head_dim 128 with GQA, a length that
# is no multiple of a block, and fp32.
SHAPES = [
    ((2, 2048, 16, 16, 64), jnp.bfloat16),
    ((2, 2048, 16, 4, 128), jnp.bfloat16),
    ((1, 1000, 8, 2, 64), jnp.bfloat16),
    ((1, 2048, 16, 16, 64), jnp.float32),
    ((1, 4096, 32, 32, 80), jnp.bfloat16),  # StableLM-3B's heads (the 3B presets), padded to 128 for Triton
]


def _one_device(target_name):
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from resformer_jax.compilation.targets import parse_target

    target = parse_target(target_name)
    mesh = Mesh(target.devices()[:1], ("x",))
    return target, (lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P())))


@needs_aot
@pytest.mark.parametrize("shape,dtype", SHAPES, ids=lambda s: "x".join(map(str, s)) if isinstance(s, tuple) else str(s))
def test_pallas_kernel_forward_and_backward_compile_to_gpu_machine_code_at_468m_shapes(shape, dtype):
    from resformer_jax.compilation.aot import compile_step
    from resformer_jax.kernels.pallas_attention import flash_attention

    target, sds = _one_device("h100x1")
    B, T, H, K, D = shape
    fwd_bwd = jax.jit(
        jax.value_and_grad(lambda q, k, v: flash_attention(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))
    )
    step = compile_step(
        "attention",
        fwd_bwd,
        (sds((B, T, H, D), dtype), sds((B, T, K, D), dtype), sds((B, T, K, D), dtype)),
        target,
        tiny_config(),
        log=lambda s: None,
    )
    # the forward, dK/dV and dQ kernels, each compiled by Triton into the executable
    assert step.custom_calls.get(TRITON) == 3, step.custom_calls
    assert int(step.machine_code.split()[0]) >= 3, step.machine_code


@needs_aot
@pytest.mark.slow
def test_the_document_masked_pallas_kernel_compiles_to_gpu_machine_code():
    """data.document_mask's Pallas kernels (segment ids, the blocks outside a block's documents skipped) lower
    through Triton for an H100 at the 468M's shape, forward and backward, as the plain ones do."""
    from resformer_jax.compilation.aot import compile_step
    from resformer_jax.kernels.pallas_attention import KERNEL_MATMULS, flash_attention, kernel_flops
    from resformer_jax.perf import packed_documents

    target, sds = _one_device("h100x1")
    B, T, H, D = 2, 2048, 16, 64
    loss = lambda q, k, v, s: flash_attention(q, k, v, segments_BxT=s).astype(jnp.float32).sum()
    qkv = [sds((B, T, H, D), jnp.bfloat16)] * 3
    documents = packed_documents(T, 256)  # the roofline counts the blocks skipped on this packing
    step = compile_step(
        "attention",
        jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))),
        (*qkv, sds((B, T), jnp.int32)),
        target,
        tiny_config(),
        log=lambda s: None,
        documents=documents,
    )
    assert step.fits and step.custom_calls.get(TRITON) == 3, (step.problem, step.custom_calls)
    assert "GPU ELF" in step.machine_code, step.machine_code
    counted = step.roofline["by_kind"]["kernel"]["flops"]
    shapes = ((B, T, H, D), (B, T, H, D), 2, True, target.kind)
    want = sum(kernel_flops(name, *shapes, documents=documents, tables=True) for name, _ in KERNEL_MATMULS)
    causal = sum(kernel_flops(name, *shapes, tables=True) for name, _ in KERNEL_MATMULS)
    assert counted == pytest.approx(want) and want < 0.5 * causal, (counted, want, causal)
    assert step.roofline["per_op_bound_s_whole_sequences"] > step.roofline["per_op_bound_s"]  # no block skipped
    spills = {k["kernel"]: k["spill_store_bytes"] + k["spill_load_bytes"] for k in step.kernel_resources}
    assert len(spills) == 3 and not any(spills.values()), spills  # ptxas -v: every kernel in its registers


@needs_aot
def test_a_kernel_over_the_gpus_shared_memory_fails_with_one_clear_message():
    """Blocks of 512 x 512 at head_dim 128 in bf16 need 1,179,648 bytes of shared memory per block (H100: 232,448):
    Triton's compilation refuses it; the project says so in one line, naming the kernel and the fix."""
    from resformer_jax.compilation.aot import CompileError, compile_step
    from resformer_jax.kernels.pallas_attention import _flash

    target, sds = _one_device("h100x1")
    q = sds((1, 1024, 4, 128), jnp.bfloat16)
    fwd = jax.jit(lambda q, k, v: _flash(q, k, v, None, None, None, True, 512, 512, False))
    with pytest.raises(CompileError) as e:
        compile_step("attention", fwd, (q, q, q), target, tiny_config(), log=lambda s: None)
    msg = str(e.value)
    assert "shared memory" in msg and "232448" in msg and "choose_blocks" in msg and "\n" not in msg


@needs_aot
def test_a_program_over_the_tpus_hbm_is_refused_by_its_compiler_with_the_precheck_message():
    """A 2.2B-parameter model (131k x 8192 embeddings) for one v5e chip (15.75 GiB): libtpu refuses to compile it;
    the report says it does not fit, with the compiler's numbers and the knobs."""
    from resformer_jax.compilation.aot import compile_for_target
    from resformer_jax.compilation.targets import parse_target

    c = tiny_config("resformer")
    m = c.model
    m.vocab_size, m.d_model, m.num_heads, m.ffn_dim, m.num_layers = 131072, 8192, 64, 8192, 2
    m.dtype, m.attention_impl, m.max_seq_len, c.data.seq_len, c.train.global_batch = "bfloat16", "auto", 128, 128, 4
    report = compile_for_target(c, parse_target("v5e-1"), steps=("train",), log=lambda s: None)
    assert not report.fits
    problem = report.first_problem
    assert "exceeds available HBM (15.75G)" in problem and "config.train.microbatch" in problem
    # remat is not full yet; one chip: sharding the state over more devices is no advice
    # (knobs at their limit are left out)
    assert "remat=full" in problem and "config.mesh.fsdp" not in problem


@needs_aot
def test_compile_command_reports_json_and_refuses_a_run_that_does_not_fit(monkeypatch):
    """The command in-process (its output and exit status are the point, not the interpreter's start)."""
    cfg = os.path.join(ROOT, "configs", "tiny.py")
    r = run_command(
        "compile",
        f"--config={cfg}",
        "--target=h100x8",
        "--steps=train,eval",
        "--config.mesh.fsdp=-1",
        "--config.mesh.data=2",
        "--config.model.attention_impl=auto",
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["fits"] and out["devices"] == 8 and out["attention_impl"] == "pallas"
    assert [s["step"] for s in out["steps"]] == ["train", "eval"]
    assert "running the GPU kernel in Pallas interpret mode" not in r.stderr
    assert "Traceback" not in r.stderr
    # the same run on cards whose allocator may use almost nothing: one line naming the numbers and the knobs
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.0000001")
    r = run_command("compile", f"--config={cfg}", "--target=h100x8", "--steps=train")
    monkeypatch.delenv("XLA_PYTHON_CLIENT_MEM_FRACTION")
    assert r.returncode == 2, r.stderr[-3000:]
    errors = [ln for ln in r.stderr.splitlines() if ln.startswith("error:")]
    # tiny.py's 8 sequences are one a GPU already: the advice leaves microbatch out and names remat and fsdp
    assert len(errors) == 1 and "the train step needs" in errors[0] and "remat=full" in errors[0], errors
    assert "config.train.microbatch" not in errors[0] and "config.mesh.fsdp (now 1 of 8)" in errors[0], errors
    assert json.loads(r.stdout.strip().splitlines()[-1])["fits"] is False
    assert "Traceback" not in r.stderr
    r = run_command("compile", f"--config={cfg}", "--target=v5e-7")
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1].startswith("error: v5e-7: no v5e slice has 7")


def test_target_names_resolve_to_cloud_tpu_and_gpu_node_layouts():
    from resformer_jax.compilation.targets import TargetError, parse_target

    t = parse_target("v5p-64")
    assert (t.platform, t.topology_name, t.num_devices, t.chip_config) == ("tpu", "v5:2x4x4", 32, "megacore")
    assert parse_target("v4-8").topology_name == "v4:2x2x1" and parse_target("v4-8").num_devices == 4
    assert parse_target("v5e-256").topology_name == "v5e:16x16"
    assert parse_target("v6e-8").topology_name == "v6e:2x4"
    assert parse_target("v5e-8", slices=2).num_devices == 16
    g = parse_target("h100x8", nodes=4)
    assert (g.platform, g.num_devices, g.nodes) == ("cuda", 32, 4)
    assert abs(g.hbm_bytes - 0.75 * 85520809984) < 1
    assert parse_target("h200x8").hbm_bytes > parse_target("a100x8").hbm_bytes
    for bad in ("v5e-7", "v9-8", "h100x16", "tpu"):
        with pytest.raises(TargetError):
            parse_target(bad)
    with pytest.raises(TargetError, match="--nodes is for GPU"):
        parse_target("v5p-8", nodes=2)


@needs_aot
def test_the_interpret_mode_warning_is_not_given_when_compiling_for_the_kernels_platform(monkeypatch):
    """The Pallas kernels warn that they run interpreted on a non-GPU backend; compiling for CUDA from a CPU is
    not that, and must not say so (the warning is for the program that will run interpreted)."""
    from resformer_jax.compilation.aot import compile_step
    from resformer_jax.kernels import pallas_attention, tpu_attention

    calls = []
    monkeypatch.setattr(pallas_attention, "_warn_interpreted", calls.append)
    monkeypatch.setattr(tpu_attention, "_warn_interpreted", calls.append)
    target, sds = _one_device("h100x1")
    q = sds((1, 128, 4, 64), jnp.bfloat16)
    compile_step(
        "attention", jax.jit(pallas_attention.flash_attention), (q, q, q), target, tiny_config(), log=lambda s: None
    )
    assert calls == []
    jax.jit(pallas_attention.flash_attention).lower(
        jnp.zeros((1, 128, 4, 64), jnp.bfloat16),
        jnp.zeros((1, 128, 4, 64), jnp.bfloat16),
        jnp.zeros((1, 128, 4, 64), jnp.bfloat16),
    )
    assert calls == ["cpu"]  # run here, it is interpreted, and says so


@needs_aot
def test_cudnn_attention_cannot_be_compiled_without_a_gpu_and_says_why():
    """cuDNN's fused attention asks the local CUDA runtime for the cuDNN version while tracing, before any compiler
    runs; with no GPU that fails. The project's guard says so in one line. Checked instead: the same steps with the
    Pallas (Triton) kernel (above) and, with XLA's own attention, the eval step (below), compiled for H100."""
    from resformer_jax.compilation.aot import compile_for_target
    from resformer_jax.compilation.targets import parse_target

    c = accelerator_config("resformer", "cuda")
    c.model.attention_impl = "cudnn"
    with pytest.raises(kernels.KernelUnavailable, match="needs an NVIDIA GPU"):
        compile_for_target(c, parse_target("h100x8"), steps=("train",), log=lambda s: None)
    c.model.attention_impl = "xla"
    report = compile_for_target(c, parse_target("h100x8"), steps=("eval",), log=lambda s: None)
    step = report.steps[0]
    # XLA's attention: the only Triton kernels are the norm's (model.norm_impl=auto takes them on a GPU)
    triton_kernels = {k["kernel"].split("__")[0] for k in step.kernel_resources}
    assert triton_kernels == {"rms_norm_fwd"}, triton_kernels  # an eval step: no backward
    assert report.fits and step.custom_calls[TRITON] >= 1 and "GPU ELF" in step.machine_code


def test_a_named_impl_that_cannot_run_raises_and_never_falls_back():
    c = tiny_config("resformer")
    c.model.attention_impl = "cudnn"
    from resformer_jax.resolve import resolve_attention

    choice = resolve_attention(c)  # named: kept as it is, nothing probed
    assert choice.impl == "cudnn" and not choice.probed
    with pytest.raises(kernels.KernelUnavailable, match="cudnn"):
        build(resolve(c, log=lambda s: None))


def test_auto_on_tpu_times_jax_splash_kernel_against_xla():
    """The probe with the backend injected as TPU compiles and runs JAX's splash kernel (interpreted here) and
    xla, times both and keeps the faster: a clock that makes splash's runs 1 ms and xla's 2 ms picks splash."""
    msgs, ticks = [], iter([0.0, 0.001] * 3 + [0.0, 0.002] * 3)  # (start, end) of each timed run, splash then xla
    choice, rejected = probe.probe_auto(
        (1, 128, 4, 64), 2, jnp.float32, msgs.append, backend="tpu", clock=lambda: next(ticks)
    )
    assert choice == "splash", (choice, rejected)
    assert "splash 1.00 ms" in msgs[0] and "xla 2.00 ms" in msgs[0], msgs
    assert set(rejected) == {"pallas", "cudnn"} and "not a GPU" in rejected["pallas"]
    candidates, _ = names.auto_candidates("gpu")
    assert candidates[0] == "pallas" and "splash" not in candidates


def test_pallas_triton_blocks_fit_the_shared_memory_budget():
    import functools

    from resformer_jax.kernels.pallas_attention import SMEM_BUDGET_BYTES, choose_blocks, smem_bytes

    for D, itemsize in ((64, 2), (128, 2), (64, 4), (128, 4), (256, 2)):
        bq, bk = choose_blocks(2048, 2048, D, itemsize)
        assert smem_bytes(bq, bk, D, itemsize) <= SMEM_BUDGET_BYTES and bq >= 16 and bk >= 16
    assert choose_blocks(2048, 2048, 64, 2) == (128, 128)
    assert functools.reduce(max, choose_blocks(2048, 2048, 128, 2)) < 128  # shrunk for head_dim 128


def test_compile_needs_its_packages_and_says_which(monkeypatch):
    from resformer_jax.compilation import aot

    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(aot.AotUnavailable, match=r"pip install -e '.\[aot\]'"):
        aot.check_packages("tpu")


@needs_aot
def test_counting_documents_on_a_run_that_does_not_mask_them_is_refused_in_one_line():
    from resformer_jax.compilation.aot import CompileError, compile_for_target
    from resformer_jax.compilation.targets import parse_target

    with pytest.raises(CompileError, match=r"--documents=512 .* add --config.data.document_mask=True") as e:
        compile_for_target(tiny_config(), parse_target("h100x1"), document_len=512, log=lambda s: None)
    assert "\n" not in str(e.value)


@needs_aot
@pytest.mark.slow
def test_the_tpu_decode_step_reads_its_pages_in_place_without_copying_the_pools():
    """At a head_dim JAX's TPU paged kernel cannot take, the blocked loop reads pages-major pools ('lanes'): the
    compiled decode step's temporaries stay far below the cache (heads-major pools were relaid out whole every
    step: several times the cache in temporaries). The sampler's bisection loops hold a few MB of their own
    (3.3 MB at this model's 32 rows of 256 logits; 0.04 GiB at the 468M's 64 rows of 50,277), under a quarter of
    even this small cache, where one relaid-out pool is the whole of it."""
    from resformer_jax.compilation.aot import compile_for_target
    from resformer_jax.compilation.targets import parse_target

    c = tiny_config("svformer")
    c.data.seq_len, c.model.max_seq_len = 512, 512
    report = compile_for_target(c, parse_target("v5e-8"), steps=("decode",), log=lambda s: None)
    token = next(s for s in report.steps if s.name == "decode_token")
    assert token.fits and token.memory.temporaries < 0.25 * token.decode["kv_cache_bytes"], (
        token.memory,
        token.decode,
    )
