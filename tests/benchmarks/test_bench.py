"""The FLOP count against XLA's, and the benchmark command."""

import json
import os
import subprocess
import sys

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from commands import run_command

from resformer_jax.config import validate
from resformer_jax.model import Transformer
from resformer_jax.perf import flops_per_token
from resformer_jax.presets import tiny_config
from resformer_jax.resolve import for_backend
from resformer_jax.train.step import loss_fn

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_flop_count_matches_xla_cost_analysis():
    c = tiny_config("resformer")
    m = c.model
    m.num_layers, m.num_heads, m.d_model, m.ffn_dim, m.vocab_size, m.max_seq_len = 4, 4, 256, 768, 4096, 256
    m.scan_layers = False  # XLA's cost analysis counts a while loop's body once, not per layer
    c.data.seq_len = 256
    m = for_backend(validate(c).model)
    B, T = 2, c.data.seq_len
    model = Transformer(m)
    params = jax.eval_shape(lambda: nn.unbox(model.init(jax.random.PRNGKey(0), jnp.zeros((1, T), jnp.int32))["params"]))
    tokens = jax.ShapeDtypeStruct((B, T + 1), jnp.int32)
    # The fused LM head + cross entropy is a scan over position blocks; one block (chunk_len=T)
    # keeps XLA's count exact (it counts a loop body once).
    compiled = (
        jax.jit(jax.value_and_grad(lambda p, t: loss_fn(p, model, t, chunk_len=T))).lower(params, tokens).compile()
    )
    ca = compiled.cost_analysis()
    xla = (ca[0] if isinstance(ca, list) else ca)["flops"]
    ours = flops_per_token(m, T) * B * T
    # XLA computes attention's full T x T scores and masks them afterwards, so it counts the half
    # that our causal count leaves out: 3 (fwd + bwd) x 2 matmuls x 2 FLOPs x T*T*H*D/2 per layer
    # and sequence. The rest (softmax, norms, SwiGLU, cross-entropy: elementwise) is in XLA's
    # count but not in a matmul-only count; it stays within the 10% tolerance.
    masked_half = m.num_layers * B * 3 * 2 * 2 * T * T * m.d_model / 2
    assert abs(xla - (ours + masked_half)) / xla < 0.10, (xla, ours, masked_half)
    assert ours < xla


@pytest.mark.slow
def test_bench_train_prints_json_and_compare_ratios():
    r = run_command(
        "bench",
        "train",
        "--config=configs/tiny.py",
        "--steps=2",
        "--compare=none,svformer",
        "--config.mesh.num_devices=1",
    )
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert [x.get("variant") for x in lines[:2]] == ["none", "svformer"]
    for x in lines[:2]:
        for key in (
            "compile_s",
            "median_step_s",
            "tokens_per_s",
            "tokens_per_s_per_device",
            "mfu_6n",
            "mfu_model",
            "peak_memory_bytes",
            "xla_memory_bytes_per_device",
        ):
            assert key in x
        assert 0 < x["mfu_model"] < 1.5
    assert "svformer" in lines[2]["ratio_to_none"]["median_step_s"]


def test_xla_defaults_keep_user_flags_and_parse_on_this_xla(monkeypatch):
    from resformer_jax.runtime import (
        CPU_XLA_FLAGS,
        GPU_XLA_FLAGS,
        configure_xla,
        cuda_plugin_present,
        jaxlib_knows_flag,
        libtpu_present,
        xla_flags_for,
    )

    monkeypatch.delenv("JAX_PLATFORMS", raising=False)
    # no GPU driver and no TPU chip here (the `aot` extra may install both plugins: compilers, not hardware); the
    # lookups must not raise
    assert cuda_plugin_present() is False
    assert libtpu_present() is False
    # The CPU defaults are flags of the jaxlib this suite installs; a made-up one is not found.
    assert all(jaxlib_knows_flag(name) for name in CPU_XLA_FLAGS)
    assert not jaxlib_knows_flag("xla_cpu_no_such_flag_anywhere")
    cpu = [f"--{k}={v}" for k, (v, _) in CPU_XLA_FLAGS.items()]
    monkeypatch.setenv("XLA_FLAGS", "--xla_foo=1")
    assert configure_xla() == cpu and os.environ["XLA_FLAGS"] == " ".join(["--xla_foo=1"] + cpu)
    # a jaxlib without the flag gets nothing (an unknown flag would abort it at start-up)
    assert xla_flags_for("--xla_foo=1", gpu=False, known=lambda name: False) == ("--xla_foo=1", [])
    # none on a TPU host (libtpu may parse XLA_FLAGS with its own XLA build)
    assert xla_flags_for("--xla_foo=1", gpu=False, tpu=True) == ("--xla_foo=1", [])
    # the user's own value wins
    mine = "--xla_cpu_experimental_ynn_fusion_type=dot"
    assert xla_flags_for(mine, gpu=False) == (mine, [])
    # GPU flags go through the same check, against the XLA the CUDA plugin carries: one it does not know is left out
    assert "pipelined_all_gather" not in " ".join(xla_flags_for("", gpu=True, known=lambda n: "pipelined" not in n)[1])
    flags, added = xla_flags_for("--xla_gpu_enable_triton_gemm=true", gpu=True, known=lambda n: True)
    assert "--xla_gpu_enable_triton_gemm=true" in flags and "--xla_gpu_enable_triton_gemm=false" not in flags
    assert len(added) == len(GPU_XLA_FLAGS) - 1 and not any(a.startswith("--xla_cpu") for a in added)
    # Unknown flags abort XLA at start-up: every default must be a flag this jaxlib knows.
    env = dict(os.environ, XLA_FLAGS=" ".join([xla_flags_for("", gpu=True)[0], *cpu]), JAX_PLATFORMS="cpu")
    r = subprocess.run(
        [sys.executable, "-c", "import jax.numpy as jnp; print(float(jnp.ones(3).sum()))"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and r.stdout.strip() == "3.0", r.stderr[-2000:]


def test_host_memory_tunables_decision():
    """runtime.host_memory_tunables: huge pages for glibc's large blocks only on a glibc that has the tunable and a
    kernel that gives THP on request; the user's own tunables kept and never overridden; nothing with the defaults
    off."""
    from resformer_jax.runtime import host_memory_tunables

    new = ("glibc", "2.36")
    assert host_memory_tunables({}, new, "madvise") == "glibc.malloc.hugetlb=1"
    assert (
        host_memory_tunables({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2"}, new, "madvise")
        == "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1"
    )
    assert host_memory_tunables({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"}, new, "madvise") is None
    assert host_memory_tunables({"RESFORMER_NO_XLA_DEFAULTS": "1"}, new, "madvise") is None
    assert host_memory_tunables({}, ("glibc", "2.31"), "madvise") is None  # no hugetlb tunable before 2.35
    assert host_memory_tunables({}, ("", ""), "madvise") is None  # musl, macOS
    assert host_memory_tunables({}, new, "always") is None and host_memory_tunables({}, new, "never") is None


def test_cpu_step_compiler_options_decision(tmp_path):
    """runtime.cpu_step_compiler_options: Eigen matmuls (YNNPACK off) only for a CPU step with >= 1,024 rows on an
    x86 CPU with AVX2 but no AVX-512; never on accelerators, AVX-512 or ARM CPUs, small steps, over the user's own
    YNNPACK setting, with the defaults off, or where the CPU's features cannot be read or this jaxlib lacks the flag."""
    from resformer_jax.runtime import CPU_XLA_FLAGS, EIGEN_STEP_MIN_ROWS, cpu_features, cpu_step_compiler_options

    name = "xla_cpu_experimental_ynn_fusion_type"
    avx2, avx512 = frozenset({"fma", "avx2"}), frozenset({"avx2", "avx512f", "avx512_bf16"})
    decide = lambda platform="cpu", rows=4096, features=avx2, env={}, known=lambda n: True: cpu_step_compiler_options(
        platform, rows, features, env, known
    )[0]
    assert decide() == {name: ""}
    assert decide(rows=EIGEN_STEP_MIN_ROWS) == {name: ""} and decide(rows=EIGEN_STEP_MIN_ROWS - 1) == {}
    assert decide(platform="gpu") == {} and decide(platform="tpu") == {}
    assert decide(features=avx512) == {} and decide(features=frozenset()) == {}
    assert decide(features=frozenset({"fp", "asimd", "sve"})) == {}  # ARM: not measured, YNNPACK kept
    assert decide(env={"RESFORMER_NO_XLA_DEFAULTS": "1"}) == {}
    assert decide(known=lambda n: False) == {}
    # the project's own default in XLA_FLAGS (runtime.configure_xla put it there) is not the user's setting
    assert decide(env={"XLA_FLAGS": f"--{name}={CPU_XLA_FLAGS[name][0]} --xla_foo=1"}) == {name: ""}
    assert decide(env={"XLA_FLAGS": f"--{name}=-reduce,-eltwise"}) == {}
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx2 fma\n\nprocessor\t: 1\n")
    assert cpu_features(str(info)) == {"fpu", "sse2", "avx2", "fma"}
    assert cpu_features(str(tmp_path / "missing")) == frozenset()


@pytest.mark.slow
def test_eigen_cpu_step_gives_the_general_steps_loss_and_gradients(monkeypatch):
    """The CPU-only path (train and eval steps compiled with YNNPACK's matmuls off, as on an AVX2 CPU without AVX-512):
    its HLO has no YNNPACK matmul where the general step has them, and one step from the same state and batch gives
    the same loss, gradient norm and parameters within fp32 summation-order tolerance."""
    from resformer_jax import runtime
    from resformer_jax.resolve import resolve
    from resformer_jax.train.setup import build

    monkeypatch.setattr(runtime, "EIGEN_STEP_MIN_ROWS", 1)  # the tiny model's 256-row step counts as large
    tokens = jax.random.randint(jax.random.PRNGKey(1), (8, 33), 0, 256)
    runs = {}
    for name, features in (("eigen", frozenset({"avx2"})), ("general", frozenset({"avx2", "avx512f"}))):
        monkeypatch.setattr(runtime, "cpu_features", lambda f=features: f)
        cfg = tiny_config("resformer")
        setup = build(resolve(cfg, log=lambda m: None))
        compiled, _, _ = setup.compile()
        hlo = compiled.as_text()
        state, metrics = compiled(setup.init_state(), tokens)
        val = setup.eval_step(state.params, tokens)[0]
        runs[name] = (setup.compiler_options, hlo.count('"__ynn_fusion"'), metrics, state.params, val)
    (opt_e, ynn_e, m_e, p_e, v_e), (opt_g, ynn_g, m_g, p_g, v_g) = runs["eigen"], runs["general"]
    assert opt_e == {"xla_cpu_experimental_ynn_fusion_type": ""} and opt_g == {}
    assert ynn_e == 0, "the Eigen step still has YNNPACK fusions"
    if ynn_g == 0:
        pytest.skip("this XLA sends no matmul of the tiny step to YNNPACK: both programs are the same")
    for key in ("loss", "grad_norm"):
        assert jnp.allclose(m_e[key], m_g[key], rtol=1e-5), (key, float(m_e[key]), float(m_g[key]))
    assert jnp.allclose(v_e, v_g, rtol=1e-5)
    for a, b in zip(jax.tree.leaves(p_e), jax.tree.leaves(p_g)):
        assert jnp.allclose(a, b, rtol=1e-4, atol=1e-6)


_HOST_MEMORY = """
import ctypes, os, resource
from resformer_jax.runtime import prepare_command_process
prepare_command_process()  # what commands/cli.run does before it imports a command
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
size = 512 << 20  # XLA temporaries' size class: far above glibc's 32 MiB mmap threshold
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
block = libc.malloc(size)
ctypes.memset(block, 1, size)
libc.free(block)
print(os.getpid(), os.environ.get("GLIBC_TUNABLES", "-"), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.slow
def test_commands_restart_once_with_huge_pages_for_large_blocks(tmp_path):
    """A command on this CPU host (run as `python -m resformer_jax.X`) restarts itself once with glibc's hugetlb
    tunable: same PID, its argv kept, and a 512 MiB block then costs hundreds of page faults, not 131,072 (the
    82M step's 2.5 GB of temporaries cost 612,000 a step without it). A library caller's process is never
    restarted, and RESFORMER_NO_XLA_DEFAULTS=1 turns it off."""
    from resformer_jax.runtime import host_memory_tunables

    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "RESFORMER_NO_XLA_DEFAULTS")}
    if host_memory_tunables(env) is None:
        pytest.skip(
            "this host needs no restart (not glibc >= 2.35 with THP in 'madvise' mode); the decision "
            "itself is tested in test_host_memory_tunables_decision"
        )
    # a module run with -m under the resformer_jax. prefix, as every command is; the package's other modules kept
    (tmp_path / "resformer_jax").mkdir()
    (tmp_path / "resformer_jax" / "__init__.py").write_text(
        "import pkgutil\n__path__ = pkgutil.extend_path(__path__, __name__)\n"
    )
    (tmp_path / "resformer_jax" / "probe.py").write_text(_HOST_MEMORY)
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), ROOT])

    def run(*args, **extra):
        p = subprocess.Popen(
            [sys.executable, *args],
            env=dict(env, **extra),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
        )
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-2000:]
        pid, tunables, faults = out.split()
        assert int(pid) == p.pid  # restarted in place, not a child: signals and process managers still reach it
        return tunables, int(faults)

    tunables, faults = run("-m", "resformer_jax.probe")
    assert tunables == "glibc.malloc.hugetlb=1" and faults < 2000, (tunables, faults)
    tunables, faults = run("-m", "resformer_jax.probe", RESFORMER_NO_XLA_DEFAULTS="1")
    assert tunables == "-" and faults > 100_000, faults
    tunables, _ = run("-c", _HOST_MEMORY)  # not a command: started as a library caller
    assert tunables == "-"


_YNN_REDUCTIONS = """
import jax, jax.numpy as jnp
from resformer_jax.benchmarks.step_profile import parse_hlo
from resformer_jax.train.loss import chunked_cross_entropy
h, w, t = jnp.ones((2, 64, 32)), jnp.ones((32, 300)), jnp.zeros((2, 64), jnp.int32)
hlo = jax.jit(jax.grad(lambda h, w: chunked_cross_entropy(h, w, t, 16), argnums=(0, 1))).lower(h, w).compile().as_text()
insts, comps = parse_hlo(hlo)
fused = [set().union(*(comps.get(c, set()) for c in insts[line.split("=")[0].split()[-1].lstrip("%")].calls))
         for line in hlo.splitlines() if '"__ynn_fusion"' in line]
print(sum("dot" in ops for ops in fused), sum(any(op.startswith("reduce") for op in ops) for ops in fused))
"""


def test_cpu_default_keeps_the_lm_head_reductions_off_ynnpack():
    """runtime.py's CPU default in effect: the fused LM head's compiled backward still sends its matmuls to
    YNNPACK but none of its reductions (the logsumexp that ran ~10x slower there); without the project's
    defaults this XLA does send them."""

    def count(xla_flags):
        env = dict(os.environ, XLA_FLAGS=xla_flags, RESFORMER_NO_XLA_DEFAULTS="1", JAX_PLATFORMS="cpu")
        r = subprocess.run(
            [sys.executable, "-c", _YNN_REDUCTIONS], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT
        )
        assert r.returncode == 0, r.stderr[-2000:]
        return tuple(int(x) for x in r.stdout.split())

    from resformer_jax.runtime import xla_flags_for

    dots, reductions = count("")
    if reductions == 0:
        pytest.skip(
            "this jaxlib no longer sends reductions to YNNPACK by default; runtime.py's CPU default "
            "(xla_cpu_experimental_ynn_fusion_type=-reduce) may go"
        )
    assert dots > 0
    dots, reductions = count(xla_flags_for("", gpu=False)[0])
    assert dots > 0 and reductions == 0, f"with the project's defaults: {dots} YNN matmuls, {reductions} reductions"


@pytest.mark.slow
def test_accelerator_check_runs_end_to_end_on_cpu(tmp_path):
    """`bench accelerator` on CPU: reduced shapes, GPU/TPU-only rows marked, the Pallas kernels' correctness
    checked interpreted, one train step per runnable impl, decode for vanilla and SVFormer."""
    out = tmp_path / "report.json"
    r = run_command("bench", "accelerator", f"--out={out}")  # in-process, as the command runs
    assert r.returncode == 0, r.stderr[-3000:]
    rep = json.loads(out.read_text())
    assert json.loads(r.stdout.strip().splitlines()[-1]) == rep
    assert rep["backend"] == "cpu" and rep["reduced_shapes"] and rep["complete"]
    assert set(rep["seconds"]) == {"attention", "norm", "auto", "decode", "train", "variants"}  # saved part by part
    norms = {x["impl"]: x for x in rep["norm"]["rows"]}  # the Pallas norm kernels checked interpreted, XLA's timed
    assert max(norms["pallas"]["max_rel_error_fp32"].values()) < 1e-5, norms["pallas"]
    assert norms["pallas"]["status"].startswith("interpreted") and norms["xla"]["status"] == "ok"
    assert norms["xla"]["fwd_bwd_ms_bf16"] > 0
    rows = {x["impl"]: x for x in rep["attention"]["rows"]}
    assert rows["cudnn"]["status"].startswith("not applicable") and "NVIDIA GPU" in rows["cudnn"]["status"]
    for impl in ("pallas", "splash", "chunked", "xla"):
        err = rows[impl]["max_rel_error"]
        assert max(err["float32"].values()) < 1e-5 and max(err["bfloat16"].values()) < 3e-2, (impl, err)
    assert "speed not applicable" in rows["pallas"]["status"] and "speed_bf16" in rows["chunked"]
    assert rep["auto"]["choice"] == "chunked"
    assert {s["impl"] for s in rep["train"]["steps"]} == {"chunked", "xla"}
    assert all(s["step_s"] > 0 and 0 < s["mfu_model"] < 1.5 for s in rep["train"]["steps"])
    assert all(s["bound"] is None and s["measured_over_bound"] is None for s in rep["train"]["steps"])  # no chip
    # the variants taking turns with auto's choice, each step paired with vanilla's of the same round
    var = {s["variant"]: s for s in rep["variants"]["rows"]}
    assert list(var) == ["none", "resformer", "svformer", "skipv1"] and rep["variants"]["impl"] == "chunked"
    assert var["none"]["paired_step_ratio_to_vanilla"] == 1.0
    assert all(0.2 < s["paired_step_ratio_to_vanilla"] < 5 and s["loss"] > 0 for s in var.values())
    assert "bench train resformer: state initialised in" in r.stderr  # each phase's seconds, for a check cut short
    assert "bench decode svformer batch 4 context 64:" in r.stderr
    dec = {(d["variant"], d["batch"]): d for d in rep["decode"]}
    assert set(dec) == {(v, b) for v in ("none", "svformer") for b in (1, 4)}  # the engine's matrix
    assert dec["svformer", 4]["kv_cache_bytes"] < dec["none", 4]["kv_cache_bytes"]
    assert all(d["fraction_of_bandwidth"] > 0 and d["decode_tokens_per_s"] > 0 for d in dec.values())
    assert "auto chose 'chunked'" in r.stderr  # the short table


def test_bench_data_reports_loader_throughput_against_the_step():
    r = run_command(
        "bench",
        "data",
        "--config=configs/demo.py",
        "--steps=20",
        "--step_tokens_per_s=1000",
        "--config.mesh.num_devices=1",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["batches"] == 20 and out["loader_tokens_per_s_per_host"] > 0
    assert abs(out["loader_over_step"] - out["loader_tokens_per_s_per_host"] / 1000) < 0.01  # both printed rounded


@pytest.mark.slow
def test_bench_decode_matrix_reports_bytes_and_bandwidth():
    r = run_command(
        "bench",
        "decode",
        "--config=configs/tiny.py",
        "--compare=none,svformer",
        "--matrix=1,2:16",
        "--new_tokens=3",
        "--rounds=1",
        "--temperature=0.7",  # every request sampled: the sampler's cost is part of the step
        "--top_k=5",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(x) for x in r.stdout.splitlines() if x.startswith("{")]
    assert [(x["variant"], x["batch"]) for x in rows] == [("none", 1), ("svformer", 1), ("none", 2), ("svformer", 2)]
    assert {x["sampling"] for x in rows} == {"temperature 0.7, top_k 5"}
    none, sv = rows[0], rows[1]
    assert sv["kv_cache_bytes_held_per_token"] < none["kv_cache_bytes_held_per_token"]  # V_1 cached once
    # ... but read by every layer, whose attention matrices differ: a step reads the same cache bytes
    assert sv["kv_bytes_read_per_step"] == none["kv_bytes_read_per_step"]
    assert sv["weight_bytes_per_step"] < none["weight_bytes_per_step"]  # no W_V in layers >= 2
    assert all(x["fraction_of_bandwidth"] > 0 and x["decode_tokens_per_s"] > 0 for x in rows)
    bad = run_command("bench", "decode", "--config=configs/tiny.py", "--matrix=1:x")
    assert bad.returncode == 2 and "BATCHES:CONTEXTS" in bad.stderr and "Traceback" not in bad.stderr
    knob = run_command("bench", "decode", "--config=configs/tiny.py", "--matrix=1:16", "--top_p=0")
    assert knob.returncode == 2 and "top_p=0.0: must be in (0, 1]" in knob.stderr and "Traceback" not in knob.stderr


def test_step_breakdown_groups_ops_by_scope_counts_self_time_and_overlap():
    """The attribution rules on a hand-made profile: nesting (a loop's body ops inside it), two threads running
    at once, and the HLO lookup that puts each op in its group."""
    from types import SimpleNamespace as NS

    from resformer_jax.benchmarks.step_profile import breakdown

    hlo = "\n".join(
        [
            "HloModule m",
            "%fused_computation.1 (p: f32[4]) -> f32[4] {",
            '  ROOT %dot.9 = f32[4]{0} dot(%p, %p), metadata={op_name="x"}',
            "}",
            "ENTRY %main (a: f32[4]) -> f32[4] {",
            "  %while.1 = (s32[], f32[4]) while(%t), condition=%cond, body=%body",
            "  %fusion.1 = f32[4]{0} fusion(%a), kind=kOutput, calls=%fused_computation.1, "
            'metadata={op_name="jit(step)/jvp(Transformer)/layers/mlp/up/dot_general"}',
            "  %fusion.2 = f32[4]{0} fusion(%a), kind=kLoop, calls=%fused_computation.1, "
            'metadata={op_name="jit(step)/transpose(jvp(Transformer))/attn/attention_kernel/dot_general"}',
            '  %add.3 = f32[4]{0} add(%a, %a), metadata={op_name="jit(step)/jvp(Transformer)/norm/add"}',
            '  %dot.4 = f32[4]{0} dot(%a, %a), metadata={op_name="jit(step)/jvp()/lm_head_xent/dot_general"}',
            '  ROOT %multiply.5 = f32[4]{0} multiply(%a, %a), metadata={op_name="jit(step)/optimizer/mul"}',
            "}",
        ]
    )
    ev = lambda name, start, dur: NS(name=name, start_ns=start, duration_ns=dur)
    # thread 1: a 100 ns loop holding fusion.1 (40) and add.3 (20); then dot.4 (30) and multiply.5 (10)
    # thread 2: fusion.2 (40) at the same time as fusion.1
    t1 = NS(
        name="tf_XLAEigen/1",
        events=[
            ev("while.1", 0, 100),
            ev("fusion.1", 10, 40),
            ev("end: fusion.1", 50, 0),
            ev("add.3", 60, 20),
            ev("dot.4", 100, 30),
            ev("multiply.5", 130, 10),
            ev("ThunkExecutor::Execute", 0, 140),
        ],
    )
    t2 = NS(name="tf_XLAEigen/2", events=[ev("fusion.2", 10, 40)])
    profile = NS(planes=[NS(name="/host:CPU", lines=[NS(name="bench.py", events=[ev("fusion.1", 0, 999)]), t1, t2])])

    def check(busy_ns, lm_head_ns):
        """Own times 40 (mlp), 40 (attention), 20 (norm), lm_head_ns, 10 (optimizer), scaled to the busy time."""
        b = breakdown(profile, hlo, wall_s=200e-9)
        sec = {k: v * 1e9 for k, v in b["seconds"].items()}
        scale = busy_ns / (40 + 40 + 20 + lm_head_ns + 10)
        expected = {
            "matmul_projections_mlp": 40 * scale,
            "attention": 40 * scale,
            "norms_elementwise": 20 * scale,
            "lm_head_xent": lm_head_ns * scale,
            "optimizer": 10 * scale,
            "host_overhead": 200 - busy_ns,
        }
        for k, v in expected.items():
            assert abs(sec[k] - v) < 0.6, (k, sec[k], v)  # reported to the nanosecond
        assert abs(sum(b["seconds"].values()) - 200e-9) < 1e-10 and b["ops_not_in_hlo"] == 0
        # the matmuls of every group: fusion.1 and fusion.2 (fusions around a dot) and dot.4, not add.3 or multiply.5
        assert abs(b["matmul_s"] * 1e9 - (40 + 40 + lm_head_ns) * scale) < 0.6, (b["matmul_s"], scale)
        return b

    # busy time: [10, 50) u [60, 80) u [100, 140) = 100 ns
    check(busy_ns=100, lm_head_ns=30)

    # XLA:CPU's Eigen matmuls return before their work is done: the shards run as thread-pool tasks (linked by a
    # context id to the Record event of whoever scheduled them). dot.4 schedules task 7 (on thread 2, after dot.4's
    # event ended), which schedules task 8 (thread 1): both are dot.4's work. Task 9 was scheduled from outside any
    # op (loop control) and task 10 ran ops itself (the executor): neither is an op's work.
    tp = lambda name, t, **stats: NS(name=name, start_ns=t, duration_ns=0, stats=list(stats.items()))
    start, stop, rec = (
        "ThreadpoolListener::StartRegion",
        "ThreadpoolListener::StopRegion",
        "ThreadpoolListener::Record",
    )
    t1.events += [tp(rec, 105, _p=7), tp(start, 145, _c=8), tp(stop, 165), tp(rec, 5, _p=9), tp(rec, 2, _p=10)]
    t2.events += [
        tp(start, 0, _c=10),
        tp(stop, 60),
        tp(start, 130, _c=7),
        tp(rec, 140, _p=8),
        tp(stop, 160),
        tp(start, 170, _c=9),
        tp(stop, 180),
    ]
    # busy: [10, 50) u [60, 80) u [100, 165) = 125 ns; dot.4's own time 30 + 30 + 20
    b = check(busy_ns=125, lm_head_ns=80)
    assert b["top_ops"][0] == {
        "op": "dot.4",
        "group": "lm_head_xent",
        "seconds": 8e-08,
        "source": "jit(step)/jvp()/lm_head_xent/dot_general",
    }


def test_step_breakdown_counts_library_gemms_as_matmuls():
    """cuBLAS GEMMs are custom-calls without a dot inside: they count as matmuls (group and `matmul_s`) by their
    target; other custom-calls do not."""
    from resformer_jax.benchmarks.step_profile import classify, is_matmul, parse_hlo

    insts, comps = parse_hlo(
        "\n".join(
            [
                "ENTRY %main (a: f32[4,4]) -> f32[4,4] {",
                '  %custom-call.1 = (f32[4,4]{1,0}, s8[0]{0}) custom-call(%a, %a), custom_call_target="__cublas$gemm", '
                'metadata={op_name="jit(step)/jvp(Transformer)/mlp/up/dot_general"}',
                '  %custom-call.2 = f32[4,4]{1,0} custom-call(%a), custom_call_target="Sharding", '
                'metadata={op_name="jit(step)/jvp(Transformer)/mlp/up/sharding"}',
                '  ROOT %custom-call.3 = f32[4,4]{1,0} custom-call(%a, %a), custom_call_target="__cublas$lt$matmul", '
                'metadata={op_name="jit(step)/jvp()/lm_head_xent/dot_general"}',
                "}",
            ]
        )
    )
    assert (
        is_matmul(insts["custom-call.1"], comps) and classify(insts["custom-call.1"], comps) == "matmul_projections_mlp"
    )
    assert (
        not is_matmul(insts["custom-call.2"], comps) and classify(insts["custom-call.2"], comps) == "norms_elementwise"
    )
    assert is_matmul(insts["custom-call.3"], comps) and classify(insts["custom-call.3"], comps) == "lm_head_xent"


def test_step_breakdown_reads_a_gpu_stream_with_and_without_command_buffers():
    """A GPU trace (as an H200's reads: one "Stream #N(...)" line of kernel events, each naming its HLO op in the
    `hlo_op` stat): a kernel whose op is a leaf of the module goes by the HLO (scope, dot); one run inside a
    CUDA-graph command buffer (hlo_op names the buffer, a call) goes by its kernel name: cuBLAS's nvjet GEMMs
    as matmuls, cuDNN's sdpa kernels as attention, the rest elementwise. No kernel is lost to the buffer."""
    from types import SimpleNamespace as NS

    from resformer_jax.benchmarks.step_profile import breakdown

    hlo = "\n".join(
        [
            "ENTRY %main (a: f32[4,4]) -> f32[4,4] {",
            '  %custom-call.1 = f32[4,4]{1,0} custom-call(%a, %a), custom_call_target="__cublas$lt$matmul", '
            'metadata={op_name="jit(step)/jvp()/lm_head_xent/dot_general"}',
            "  %fusion.7 = f32[4,4]{1,0} fusion(%a), kind=kLoop, calls=%f, "
            'metadata={op_name="jit(step)/optimizer/mul"}',
            "  %command_buffer_3 = f32[4,4]{1,0} call(%a), to_apply=%cb",
            "}",
        ]
    )
    ev = lambda name, start, dur, op: NS(name=name, start_ns=start, duration_ns=dur, stats=[("hlo_op", op)])
    stream = NS(
        name="Stream #14(Memset,Compute)",
        events=[
            ev("nvjet_sm90_tst_128x160_64x5_2x1_v_bz_NNT", 0, 30, "custom-call.1"),  # by the HLO: the LM head
            ev("loop_multiply_fusion", 30, 10, "fusion.7"),  # by the HLO: the optimizer
            ev("nvjet_sm90_tss_128x256_64x4_4x2_h_bz_coopA_NTN", 40, 20, "command_buffer_3"),
            ev("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_26", 60, 15, "command_buffer_3"),
            ev("void cudnn::fusion::convert_dq_to_16bits<true>(void const*, void*)", 75, 5, "command_buffer_3"),
            ev("loop_convert_fusion", 80, 10, "command_buffer_3"),
        ],
    )
    profile = NS(
        planes=[
            NS(name="/host:CPU", lines=[NS(name="python", events=[])]),
            NS(name="/device:GPU:0", lines=[stream]),
        ]
    )
    b = breakdown(profile, hlo, wall_s=100e-9)
    sec = {k: round(v * 1e9, 3) for k, v in b["seconds"].items()}
    assert sec == {
        "matmul_projections_mlp": 20,
        "attention": 20,
        "lm_head_xent": 30,
        "norms_elementwise": 10,
        "optimizer": 10,
        "host_overhead": 10,
    }, sec
    assert abs(b["matmul_s"] * 1e9 - (30 + 20 + 15)) < 1e-6  # the GEMMs and the sdpa kernel; not the dq convert
    assert b["ops_not_in_hlo"] == 4


def test_step_breakdown_innermost_interval_lookup_matches_the_definition():
    """The bisection index that attributes thread-pool tasks (a real CPU step has ~10^5 of them; a scan per lookup
    took 4-5 minutes a profiled step): for every probe time, the latest-starting interval holding it, the first
    listed among equal starts, exactly as a scan over all intervals finds it."""
    import random

    from resformer_jax.benchmarks.step_profile import _Innermost

    rng = random.Random(0)
    for _ in range(50):
        intervals = []
        for k in range(rng.randrange(0, 40)):  # nested and disjoint spans, with repeated starts and gaps
            s = rng.randrange(0, 200)
            intervals.append((s, s + rng.randrange(1, 60), f"op{k}"))
        index = _Innermost(intervals)
        for t in range(-5, 270):
            inside = [iv for iv in intervals if iv[0] <= t < iv[1]]
            expected = max(inside, key=lambda iv: iv[0], default=None)
            assert index.at(t) == expected, (intervals, t)


def test_step_breakdown_ops_without_metadata_take_their_loops_scope():
    """XLA builds some ops inside a loop body without metadata (the chunked attention's lax.map on CPU): they count
    in the group of the loop that runs them; an op without a scope anywhere stays where its opcode puts it."""
    from resformer_jax.benchmarks.step_profile import classify, parse_hlo

    hlo = "\n".join(
        [
            "HloModule m",
            "%fused.1 (p: f32[4]) -> f32[4] {",
            "  ROOT %dot.1 = f32[4]{0} dot(%p, %p)",
            "}",
            "%body (t: (s32[], f32[4])) -> (s32[], f32[4]) {",
            "  %fusion.6 = f32[4]{0} fusion(%x), kind=kCustom, calls=%fused.1",
            "  ROOT %tuple.1 = (s32[], f32[4]) tuple(%i, %fusion.6)",
            "}",
            "ENTRY %main (a: f32[4]) -> f32[4] {",
            "  %while.2 = (s32[], f32[4]) while(%t), condition=%cond, body=%body, "
            'metadata={op_name="jit(step)/jvp(Transformer)/attn/attention_kernel/while"}',
            "  ROOT %fusion.7 = f32[4]{0} fusion(%a), kind=kCustom, calls=%fused.1",
            "}",
        ]
    )
    insts, comps = parse_hlo(hlo)
    assert classify(insts["fusion.6"], comps) == "attention"
    assert insts["fusion.6"].op_name == "jit(step)/jvp(Transformer)/attn/attention_kernel/while"
    assert classify(insts["fusion.7"], comps) == "matmul_projections_mlp"


@pytest.mark.slow
def test_bench_train_step_breakdown_sums_to_the_step_time(tmp_path):
    """One profiled step of a small model (the demo's, at batch 32): every group present, and the groups add up to the
    measured step time within 10%; the trace is written where --profile_dir says."""
    from resformer_jax.benchmarks.step_profile import GROUPS

    p = run_command(  # in-process, as the command runs
        "bench",
        "train",
        "--config=configs/demo.py",
        "--steps=3",
        "--profile_steps=3",
        f"--profile_dir={tmp_path}",
        "--config.mesh.num_devices=1",
        "--config.model.dtype=bfloat16",  # not the dtype probe (tests/kernels/test_precision.py)
        # twice the demo's batch: the profiler's own cost per op (~8% of the demo's 0.25 s step,
        # which runs ~1,000 ops) then weighs half as much
        "--config.train.global_batch=32",
    )
    assert p.returncode == 0, p.stderr[-3000:]
    (r,) = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    b = r["step_breakdown"]
    assert set(b["seconds"]) == set(GROUPS) and min(b["seconds"].values()) >= 0
    total = sum(b["seconds"].values())
    assert abs(total - b["profiled_step_s"]) < 1e-3 * b["profiled_step_s"]
    # Each profiled step against the fastest unprofiled step before it: the profile is of the step timed (a
    # profile of another program would be far outside). Not a timing comparison (`resformer bench train` is): the
    # profiler's own 7-12% and the other test worker, busy or idle through either step (0.84 seen), fit the bounds.
    assert 0.5 <= b["profiled_over_timed_step"] <= 2.0, (b["profiled_over_timed_step"], total, r["step_s"])
    for g in ("matmul_projections_mlp", "attention", "lm_head_xent", "norms_elementwise", "optimizer"):
        assert b["seconds"][g] > 0, g
    assert b["ops_not_in_hlo"] == 0
    # the matmuls' seconds: at least the projections group (matmuls only), below the busy time; the step's model
    # FLOPs over them are the matmuls' rate, and a step of only matmuls would beat the real step's MFU
    busy = total - b["seconds"]["host_overhead"]
    assert b["seconds"]["matmul_projections_mlp"] * 0.999 <= b["matmul_s"] < busy, b
    share = b["matmul_s"] / b["profiled_step_s"]
    step_flops = r["flops_per_token"] * 32 * r["seq_len"]
    assert abs(r["matmul_flops_per_s_in_step"] * share * r["median_step_s"] / step_flops - 1) < 1e-3
    assert abs(r["mfu_model_matmuls_only"] - r["matmul_flops_per_s_in_step"] / r["peak_flops"]) < 1e-9
    assert r["mfu_model_matmuls_only"] > r["mfu_model"], r
    assert b["top_ops"] and all(o["group"] in GROUPS and o["seconds"] > 0 for o in b["top_ops"])
    # MFU against the paired peak samples lies between those against the best and the lowest sample
    assert r["mfu_model"] * 0.999 <= r["mfu_model_vs_paired_peak"], r
    assert any(f.endswith(".xplane.pb") for _, _, fs in os.walk(tmp_path / "resformer") for f in fs)


@pytest.mark.slow
def test_bench_train_compares_dtypes_interleaved():
    """--compare_dtypes runs fp32 and bf16 of one variant in one process, step by step, each against the matmul
    peak of its own dtype, and prints their ratio (the bf16-vs-fp32 speed-up without two runs' host drift)."""
    p = run_command(
        "bench",
        "train",
        "--config=configs/demo.py",
        "--steps=2",
        "--profile_steps=0",
        "--config.mesh.num_devices=1",
        "--compare_dtypes=float32,bfloat16",
    )
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(x) for x in p.stdout.splitlines() if x.startswith("{")]
    f32, b16, ratio = rows
    assert (f32["dtype"], b16["dtype"]) == ("float32", "bfloat16")
    assert "fp32 matmul" in f32["peak_source"] and "bf16 matmul" in b16["peak_source"]
    assert len(f32["step_s"]) == len(b16["step_s"]) == 2
    want = round(b16["median_step_s"] / f32["median_step_s"], 4)
    assert ratio["ratio_to_resformer/float32"]["median_step_s"] == {
        "resformer/float32": 1.0,
        "resformer/bfloat16": want,
    }
    assert set(ratio["paired_median_step_ratio"]) == {"resformer/float32", "resformer/bfloat16"}


def test_bench_documents_are_packed_with_the_last_id_at_their_mean_length():
    """bench train --documents=N: the batches' rows are documents of mean length N ended by the last token id,
    which the uniform ids leave out; N = 0 keeps plain uniform ids."""
    import numpy as np

    from resformer_jax.benchmarks.timing import random_tokens

    plain = np.asarray(random_tokens((8, 4096), 256))
    docs = np.asarray(random_tokens((8, 4096), 256, document_len=64))
    assert plain.max() == 255 and (plain == 255).mean() < 0.01
    assert docs.max() == 255 and docs.shape == (8, 4096)
    ends = docs == 255
    mean_len = docs.size / ends.sum()
    assert 56 < mean_len < 72, mean_len  # geometric lengths, mean 64
    assert ends.sum(axis=1).min() > 0  # every row holds several documents


# slow (over the fast tier's 5 s, cold, 2 cores): a decode benchmark's engine, with the prefix cache on and off
@pytest.mark.slow
def test_bench_decode_stream_shared_prefixes_computes_each_prefix_once():
    """`bench decode --stream --shared_prefixes=N` (the prefix benchmarks' workload through the engine, no server):
    with the prefix cache, each of the N prefixes is computed once and every later request takes its pages, so the
    prompt tokens computed fall by exactly (requests - N) * prefix_len; without it every prompt token is computed;
    SVFormer's K pages and V_1 chain are shared as vanilla's K and V are."""
    from resformer_jax.benchmarks.decode import bench_decode_stream
    from resformer_jax.model.config import ModelConfig
    from resformer_jax.presets import tiny_config

    models = [ModelConfig.of(tiny_config(v).model).replace(dtype="float32") for v in ("none", "svformer")]
    kw = dict(cache_gib=0.01, requests=8, rate=0.0, max_context=24, new_tokens=2, shared_prefixes=2, prefix_len=32)
    on = bench_decode_stream(models, **kw)
    off = bench_decode_stream(models[:1], **kw, prefix_cache=False)
    for r in on:
        assert r["prefill_tokens_computed"] == r["prompt_tokens"] - (8 - 2) * 32, r
        assert r["prefix_hit_rate"] == round((8 - 2) * 32 / r["prompt_tokens"], 4) and r["preemptions"] == 0
    assert off[0]["prefill_tokens_computed"] == off[0]["prompt_tokens"] and off[0]["prefix_hit_rate"] == 0
    assert on[0]["prompt_tokens"] == off[0]["prompt_tokens"]  # the same stream: the seed's prompts
    # --prompt_min=--context: prompts of one length (the capacity load in docs/evaluation.md)
    one = bench_decode_stream(models[:1], **{**kw, "shared_prefixes": 0}, prompt_min=24)
    assert one[0]["prompt_tokens"] == 8 * 24, one


def test_each_benchmark_reads_the_flags_its_table_names_and_refuses_another_s():
    """commands/bench.py's BENCHMARK_FLAGS is the one table of which flag is whose: every flag the command defines
    (but --config and --compare) belongs to a benchmark whose runner reads it; a flag given to a benchmark that does
    not read it is one usage line naming the benchmarks that do (it was silently ignored)."""
    import ast
    import pathlib

    tree = ast.parse((pathlib.Path(ROOT) / "resformer_jax" / "commands" / "bench.py").read_text())
    table = ast.literal_eval(
        next(n.value for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "BENCHMARK_FLAGS")
    )
    funcs = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}

    def reads(name, seen):
        if name in seen or name not in funcs:
            return set()
        seen.add(name)
        out = set()
        for n in ast.walk(funcs[name]):
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "FLAGS":
                out.add(n.attr)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name):
                out |= reads(n.func.id, seen)
        return out

    defined = {
        n.value.args[0].value
        for n in tree.body
        if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call) and "DEFINE" in ast.unparse(n.value.func)
    }
    assert defined - {"config", "compare"} == {f for names in table.values() for f in names}
    for bench, names in table.items():
        missing = set(names) - reads(f"run_{bench}", set())
        assert not missing, f"bench {bench} lists flags its runner does not read: {missing}"
    r = run_command("bench", "train", "--config=configs/tiny.py", "--cache_gib=1")
    assert r.returncode != 0 and "--cache_gib is not a flag of bench train" in r.stderr, r.stderr[-800:]
    assert "read by bench decode" in r.stderr and "Traceback" not in r.stderr


def test_bench_zero_shot_scores_the_sample_tasks_at_a_configs_shape():
    """`bench zero_shot` (README's command) types and resolves its config before it builds the model (it handed
    the model a ConfigDict and ended in a traceback): items/s and the full split's projected time, one JSON row."""
    shared = os.path.join(os.path.dirname(ROOT), "shared", "data")
    if not os.path.isdir(shared):
        pytest.skip("../shared/data (the sample tasks and the NeoX tokenizer) is absent")
    r = run_command(
        "bench",
        "zero_shot",
        "--config=configs/tiny.py",
        f"--task_data={shared}/eval_samples",
        f"--tokenizer={shared}/tokenizers/gpt-neox-20b.json",
        "--items=4",
        "--tasks=piqa",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    row = json.loads(r.stdout.strip().splitlines()[-1])
    assert row["task"] == "piqa" and row["items"] == 4 and row["choices"] == 8 and row["items_per_s"] > 0
    assert row["full_split_items"] == 1838
