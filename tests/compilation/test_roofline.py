# ruff: noqa: E501 - HLO text fixtures are kept as XLA prints them, one instruction a line
"""The compile report's roofline (compilation/roofline.py) against programs whose FLOPs and bytes are known by hand, for
a GPU and a TPU target, and ptxas' register report naming a spilling kernel. Compiling needs the aot extra
(CI installs it); the HLO-text tests run everywhere."""

import importlib.util

import jax
import jax.numpy as jnp
import pytest
from jax import lax

from resformer_jax.compilation import roofline as rl

MISSING = [
    pkg
    for pkg, mod in (("jax[tpu]", "libtpu"), ("the CUDA plugin", "jax_cuda12_plugin"))
    if importlib.util.find_spec(mod) is None
]
needs_aot = pytest.mark.skipif(
    bool(MISSING), reason=f"needs {' and '.join(MISSING)}: pip install -e '.[aot]' (CI installs it)"
)
H100, V5E = rl.chip_for("NVIDIA H100 SXM 80GB"), rl.chip_for("TPU v5e")

HLO = """HloModule m

%fused_update (param_0: f32[8,64,32], param_1: f32[64,32], param_2: s32[]) -> f32[8,64,32] {
  %param_0 = f32[8,64,32]{2,1,0} parameter(0)
  %param_1 = f32[64,32]{1,0} parameter(1)
  %param_2 = s32[] parameter(2)
  %bitcast = f32[1,64,32]{2,1,0} bitcast(%param_1)
  %zero = s32[] constant(0)
  ROOT %dus = f32[8,64,32]{2,1,0} dynamic-update-slice(%param_0, %bitcast, %param_2, %zero, %zero)
}

%body (p: (s32[], f32[64,32], f32[32,32], f32[8,64,32])) -> (s32[], f32[64,32], f32[32,32], f32[8,64,32]) {
  %p = (s32[], f32[64,32]{1,0}, f32[32,32]{1,0}, f32[8,64,32]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%p), index=0
  %x = f32[64,32]{1,0} get-tuple-element(%p), index=1
  %w = f32[32,32]{1,0} get-tuple-element(%p), index=2
  %stack = f32[8,64,32]{2,1,0} get-tuple-element(%p), index=3
  %d = f32[64,32]{1,0} dot(%x, %w), lhs_contracting_dims={1}, rhs_contracting_dims={0}, metadata={op_name="jit(f)/mlp/dot_general"}
  %u = f32[8,64,32]{2,1,0} fusion(%stack, %d, %i), kind=kLoop, calls=%fused_update
  ROOT %t = (s32[], f32[64,32]{1,0}, f32[32,32]{1,0}, f32[8,64,32]{2,1,0}) tuple(%i, %d, %w, %u)
}

%cond (p: (s32[], f32[64,32], f32[32,32], f32[8,64,32])) -> pred[] {
  %p = (s32[], f32[64,32]{1,0}, f32[32,32]{1,0}, f32[8,64,32]{2,1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

ENTRY %main (x0: f32[64,32], w0: f32[32,32], s0: f32[8,64,32]) -> f32[64,32] {
  %x0 = f32[64,32]{1,0} parameter(0)
  %w0 = f32[32,32]{1,0} parameter(1)
  %s0 = f32[8,64,32]{2,1,0} parameter(2)
  %zero = s32[] constant(0)
  %t0 = (s32[], f32[64,32]{1,0}, f32[32,32]{1,0}, f32[8,64,32]{2,1,0}) tuple(%zero, %x0, %w0, %s0)
  %loop = (s32[], f32[64,32]{1,0}, f32[32,32]{1,0}, f32[8,64,32]{2,1,0}) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"8"}}
  %ar = f32[64,32]{1,0} all-reduce(%x0), replica_groups={}, to_apply=%cond
  ROOT %out = f32[64,32]{1,0} get-tuple-element(%loop), index=1
}
"""


def test_hand_written_program_dot_in_a_loop_in_place_update_and_a_collective():
    r = rl.roofline(HLO, H100)
    dot = 2 * 64 * 32 * 32
    assert r.flops == 8 * dot  # the body's dot, eight times (the known trip count)
    gemm = next(o for o in r.ops if o.name == "d")
    assert gemm.kind == "gemm" and gemm.executions == 8 and gemm.scope == "jit(f)/mlp/dot_general"
    assert gemm.bytes == 8 * 4 * (64 * 32 + 32 * 32 + 64 * 32)  # both operands read, the result written
    upd = next(o for o in r.ops if o.name == "u")
    assert upd.bytes == 8 * 4 * (64 * 32 + 1 + 64 * 32)  # the update (and the index) read, only the update written
    assert r.collective_bytes == 4 * 64 * 32 and r.unknown_trip_counts == 0
    per_op = sum(
        max(o.flops / H100.peak_flops, o.bytes / H100.hbm_bytes_per_s) for o in r.ops if o.kind != "collective"
    )
    assert r.per_op_bound_s == pytest.approx(per_op)
    assert r.program_bound_s == pytest.approx(max(r.flops / H100.peak_flops, r.hbm_bytes / H100.hbm_bytes_per_s))
    rep = r.report(model_flops_per_device=r.flops, model_6n_flops_per_device=r.flops / 2)
    assert rep["mfu_ceiling_model"] == pytest.approx(r.flops / (r.per_op_bound_s * H100.peak_flops))
    assert rep["mfu_ceiling_6n"] == pytest.approx(rep["mfu_ceiling_model"] / 2)
    assert "not a timing" in rep["label"] and rep["chip"]["source"].startswith("NVIDIA H100 datasheet")


SCAN_HLO = """HloModule s

%fused_save (param_0: f32[8,64,32], param_1: s32[], param_2: f32[64,32], param_3: f32[32,32]) -> (f32[8,64,32], f32[64,32]) {
  %param_0 = f32[8,64,32]{2,1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %param_2 = f32[64,32]{1,0} parameter(2)
  %param_3 = f32[32,32]{1,0} parameter(3)
  %dot = f32[64,32]{1,0} dot(%param_2, %param_3), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %bitcast = f32[1,64,32]{2,1,0} bitcast(%dot)
  %zero = s32[] constant(0)
  %dus = f32[8,64,32]{2,1,0} dynamic-update-slice(%param_0, %bitcast, %param_1, %zero, %zero)
  ROOT %t = (f32[8,64,32]{2,1,0}, f32[64,32]{1,0}) tuple(%dus, %dot)
}

%fused_slice (param_0: f32[8,64,32], param_1: s32[]) -> f32[64,32] {
  %param_0 = f32[8,64,32]{2,1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %zero = s32[] constant(0)
  %ds = f32[1,64,32]{2,1,0} dynamic-slice(%param_0, %param_1, %zero, %zero), dynamic_slice_sizes={1,64,32}
  ROOT %b = f32[64,32]{1,0} bitcast(%ds)
}

%fused_read (param_0: f32[8,64,32], param_1: s32[], param_2: f32[32,32]) -> f32[64,32] {
  %param_0 = f32[8,64,32]{2,1,0} parameter(0)
  %param_1 = s32[] parameter(1)
  %param_2 = f32[32,32]{1,0} parameter(2)
  %x = f32[64,32]{1,0} fusion(%param_0, %param_1), kind=kLoop, calls=%fused_slice
  ROOT %dot = f32[64,32]{1,0} dot(%x, %param_2), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

ENTRY %main (s0: f32[8,64,32], i0: s32[], x0: f32[64,32], w0: f32[32,32]) -> (f32[8,64,32], f32[64,32]) {
  %s0 = f32[8,64,32]{2,1,0} parameter(0)
  %i0 = s32[] parameter(1)
  %x0 = f32[64,32]{1,0} parameter(2)
  %w0 = f32[32,32]{1,0} parameter(3)
  %save = (f32[8,64,32]{2,1,0}, f32[64,32]{1,0}) fusion(%s0, %i0, %x0, %w0), kind=kOutput, calls=%fused_save
  %stack = f32[8,64,32]{2,1,0} get-tuple-element(%save), index=0
  %read = f32[64,32]{1,0} fusion(%stack, %i0, %w0), kind=kOutput, calls=%fused_read
  ROOT %out = (f32[8,64,32]{2,1,0}, f32[64,32]{1,0}) tuple(%stack, %read)
}
"""


def test_a_scans_saved_matmul_writes_its_slice_and_its_reader_reads_only_the_slice():
    """A matmul fused with its save into a scan's stacked buffer (a tuple of the in-place update and the result)
    writes the slice and the result, not the stack; a matmul reading the stack through a nested slicing fusion
    reads one slice, not the stack (a 7B scan counted 2.8 GB a layer for each: a bound 1.3x too long)."""
    r = rl.roofline(SCAN_HLO, H100)
    slice_b, w_b, idx = 4 * 64 * 32, 4 * 32 * 32, 4
    save = next(o for o in r.ops if o.name == "save")
    assert save.bytes == idx + slice_b + w_b + 2 * slice_b  # x, w and the index read; the slice and the result written
    read = next(o for o in r.ops if o.name == "read")
    assert read.bytes == slice_b + idx + w_b + slice_b  # one slice of the stack, the index, w; the result


def test_gpu_async_reduce_scatter_and_all_to_all_are_collectives_not_memory_traffic():
    """XLA:GPU's async reduce-scatter and all-to-all (FSDP's gradient reduction): on the links, overlapped, not in
    the bound (counted as HBM traffic they were 0.6 s a step of a 7B FSDP step on 8 H100s)."""
    text = """HloModule a

%sum (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (g: f32[64,32]) -> f32[8,32] {
  %g = f32[64,32]{1,0} parameter(0)
  %rs = ((f32[64,32]{1,0}), f32[8,32]{1,0}) reduce-scatter-start(%g), replica_groups={{0,1,2,3,4,5,6,7}}, dimensions={0}, to_apply=%sum
  %rsd = f32[8,32]{1,0} reduce-scatter-done(%rs)
  %aa = ((f32[8,32]{1,0}), f32[8,32]{1,0}) all-to-all-start(%rsd), replica_groups={{0,1,2,3,4,5,6,7}}
  ROOT %aad = f32[8,32]{1,0} all-to-all-done(%aa)
}
"""
    r = rl.roofline(text, H100)
    assert {o.name: o.kind for o in r.ops} == {"rs": "collective", "aa": "collective"}
    assert r.per_op_bound_s == 0 and r.collective_bytes > 0


def test_an_instruction_over_several_lines_is_one_instruction():
    text = HLO.replace(
        "%ar = f32[64,32]{1,0} all-reduce(%x0), replica_groups={}, to_apply=%cond",
        "%ar = f32[64,32]{1,0} all-reduce(%x0), replica_groups={}, to_apply=%cond, "
        'frontend_attributes={kernel_metadata={\n  "a": "}"\n}}',
    )
    comps, entry = rl.parse_module(text)
    assert [i.name for i in comps[entry]][-2:] == ["ar", "out"]


def test_ptxas_report_is_parsed():
    from resformer_jax.compilation.ptxas import parse_ptxas

    text = """ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'flash_attention_dkdv' for 'sm_90a'
ptxas info    : Function properties for flash_attention_dkdv
    504 bytes stack frame, 604 bytes spill stores, 504 bytes spill loads
ptxas info    : Used 255 registers, used 1 barriers, 504 bytes cumulative stack size
ptxas info    : Compiling entry function 'flash_attention_fwd' for 'sm_90a'
ptxas info    : Function properties for flash_attention_fwd
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 186 registers, used 1 barriers
"""
    dkdv, fwd = parse_ptxas(text)
    assert (dkdv.kernel, dkdv.registers, dkdv.spill_store_bytes, dkdv.spill_load_bytes) == (
        "flash_attention_dkdv",
        255,
        604,
        504,
    )
    assert dkdv.spills and not fwd.spills and fwd.registers == 186


def _device(target_name):
    from jax.sharding import Mesh, NamedSharding
    from jax.sharding import PartitionSpec as P

    from resformer_jax.compilation.targets import parse_target

    target = parse_target(target_name)
    mesh = Mesh(target.devices()[:1], ("x",))
    return target, (
        lambda shape, dtype=jnp.bfloat16: jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, P()))
    )


def _compile(target, fn, *args):
    from resformer_jax.compilation.aot import compile_step
    from resformer_jax.presets import tiny_config

    return compile_step("probe", jax.jit(fn), args, target, tiny_config(), log=lambda s: None)


@needs_aot
@pytest.mark.parametrize("target_name", ["h100x1", "v5e-1"])
def test_one_matmul_and_a_matmul_in_a_scan(target_name):
    target, sds = _device(target_name)
    M, K, N = 1024, 256, 1024  # one GEMM on both (a larger K makes XLA:GPU split it over K without autotuning)
    step = _compile(target, lambda a, b: a @ b, sds((M, K)), sds((K, N)))
    r = step.roofline
    assert r["flops_per_device"] == 2 * M * K * N
    assert r["by_kind"]["gemm"]["flops"] == 2 * M * K * N
    gemm_bytes = r["by_kind"]["gemm"]["bytes"]
    # bf16 operands read, the bf16 result written; on TPU an operand XLA prefetched into VMEM read by the prefetch
    hbm_bytes = gemm_bytes + r["by_kind"]["other"]["bytes"]
    assert hbm_bytes == 2 * (M * K + K * N + M * N), (gemm_bytes, hbm_bytes)
    assert r["per_op_bound_s"] >= max(
        2 * M * K * N / r["chip"]["peak_flops"], gemm_bytes / r["chip"]["hbm_bytes_per_s"]
    )

    def scanned(x, w):
        return lax.scan(lambda c, _: (c @ w, None), x, None, length=7)[0]

    r = _compile(target, scanned, sds((M, N)), sds((N, N))).roofline
    assert r["by_kind"]["gemm"]["flops"] == 7 * 2 * M * N * N
    assert r["unknown_trip_counts"] == 0


@needs_aot
def test_a_pallas_kernel_call_on_gpu_counts_its_causal_blocks():
    from resformer_jax.kernels.pallas_attention import _forward

    target, sds = _device("h100x1")
    B, T, H, D = 2, 256, 4, 64
    r = _compile(target, lambda q, k, v: _forward(q, k, v, True, 128, 128)[0], *(sds((B, T, H, D)),) * 3).roofline
    # 128 x 128 blocks: query block 0 sees key block 0, query block 1 sees blocks 0 and 1 (3 of 4); QK^T and PV
    assert r["by_kind"]["kernel"]["flops"] == B * H * 3 * (2 * 128 * 128 * D) * 2
    assert r["by_kind"]["kernel"]["executions"] == 1


@needs_aot
def test_a_pallas_kernel_call_on_tpu_counts_its_causal_blocks():
    from resformer_jax.kernels.tpu_attention import splash_attention

    target, sds = _device("v5e-1")
    B, T, H, D = 1, 1024, 2, 128
    r = _compile(target, lambda q, k, v: splash_attention(q, k, v), *(sds((B, T, H, D)),) * 3).roofline
    # splash blocks of 512: query block 0 sees key block 0, query block 1 blocks 0 and 1 (3 of 4), per head
    assert r["by_kind"]["kernel"]["flops"] == B * H * 3 * (2 * 512 * 512 * D) * 2
    assert "xla_cost_analysis" in r  # libtpu answers cost_analysis(): both are in the report


@pytest.mark.slow
@needs_aot
def test_a_spilling_block_choice_is_reported_from_ptxas(monkeypatch):
    """At the 468M shape (T 2,048, 16 heads of 64, bf16) the kernels on 128 x 128 tiles spill with 4 warps and
    not with the 8 the project gives them."""
    from resformer_jax.kernels import pallas_attention
    from resformer_jax.kernels.pallas_attention import flash_attention

    target, sds = _device("h100x1")
    args = (sds((1, 2048, 16, 64)),) * 3

    def fwd_bwd():  # a new function each time: jit's trace cache would hand back the first kernels
        return jax.value_and_grad(lambda q, k, v: flash_attention(q, k, v).astype(jnp.float32).sum(), argnums=(0, 1, 2))

    ok = {k["kernel"]: k for k in _compile(target, fwd_bwd(), *args).kernel_resources}
    assert set(ok) == {"flash_attention_fwd", "flash_attention_dkdv", "flash_attention_dq"}
    assert all(k["spill_store_bytes"] == 0 and k["spill_load_bytes"] == 0 for k in ok.values()), ok
    monkeypatch.setattr(pallas_attention, "num_warps", lambda bq, bk: 4)
    step = _compile(target, fwd_bwd(), *args)
    spilled = {k["kernel"]: k for k in step.kernel_resources}
    assert spilled["flash_attention_dkdv"]["spill_store_bytes"] > 0, spilled
    from resformer_jax.compilation.aot import CompileReport

    lines = "\n".join(CompileReport(target, "pallas", "bfloat16", {}, 1, "none", [step], {}).lines())
    assert "kernel flash_attention_dkdv: 255 registers, SPILLS" in lines


@needs_aot
@pytest.mark.slow  # six Pallas kernels compiled for an H100: 3.6 s alone, over the fast tier's 5 s beside a worker
def test_value_mix_kernels_compile_for_h100_in_their_registers_and_count_as_the_plain_ones():
    """ResFormer's mix inside the kernels (value_mix, learned lambdas: the dK/dV kernel's extra outputs) at the
    468M's attention shape: every kernel, plain and mixed (each reported by its own name), in its registers, and the
    roofline counting the mixed kernels' FLOPs as the plain ones' (the same matmuls)."""
    from resformer_jax.kernels.pallas_attention import flash_attention

    target, sds = _device("h100x1")
    qkv = (sds((1, 2048, 16, 64)),) * 3

    def loss(q, k, v, v1, lam):
        plain = flash_attention(q, k, v)
        mixed = flash_attention(q, k, v, value_mix=(v1, lam), lambda_grads=True)
        return (plain.astype(jnp.float32) + mixed.astype(jnp.float32)).sum()

    step = _compile(target, jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)), *qkv, qkv[0], sds((2,), jnp.float32))
    kernels = {k["kernel"]: k for k in step.kernel_resources}
    names = ("flash_attention_fwd", "flash_attention_dkdv", "flash_attention_dq")
    assert set(kernels) == {*names, *(n + "_value_mix" for n in names)}, sorted(kernels)
    assert all(k["spill_store_bytes"] == 0 and k["spill_load_bytes"] == 0 for k in kernels.values()), kernels
    from resformer_jax.kernels.pallas_attention import KERNEL_MATMULS, kernel_flops

    one = sum(kernel_flops(n, (1, 2048, 16, 64), (1, 2048, 16, 64), 2, True, target.kind) for n, _ in KERNEL_MATMULS)
    assert step.roofline["by_kind"]["kernel"]["flops"] == pytest.approx(2 * one)


def test_ptxas_report_keeps_a_kernel_xla_renamed(tmp_path, monkeypatch):
    """Two different kernels of one name reach the PTX as NAME and NAME__1: both are reported."""
    from resformer_jax.compilation import ptxas

    (tmp_path / "a.ptx").write_text(".entry flash_attention_fwd(\n.entry flash_attention_fwd__1(\n.entry other(\n")
    seen = []

    def fake_run(cmd, **kw):
        seen.append(cmd)
        text = "".join(
            f"ptxas info    : Compiling entry function '{n}' for 'sm_90a'\nptxas info    : Used {r} registers\n"
            for n, r in (("flash_attention_fwd", 186), ("flash_attention_fwd__1", 190), ("other", 10))
        )
        return type("R", (), {"stdout": text, "stderr": ""})()

    monkeypatch.setattr(ptxas.subprocess, "run", fake_run)
    got = ptxas.kernel_resources(str(tmp_path), {"flash_attention_fwd"}, "sm_90a", ptxas="ptxas")
    assert [(k.kernel, k.registers) for k in got] == [("flash_attention_fwd", 186), ("flash_attention_fwd__1", 190)]


def _tiny_tune_grid():
    from resformer_jax.compilation.aot import tune_candidates
    from resformer_jax.presets import tiny_config

    c = tiny_config()  # configs/tiny.py's model and batch
    return tune_candidates(c, 8)


def test_tune_tries_every_remat_policy_layout_and_mesh_a_user_would():
    """`compile --tune`'s settings for the tiny config on 8 devices: every remat policy, the layers scanned or
    unrolled, the state replicated or sharded over all 8 (one sequence a device: one microbatch of 8)."""
    got = [
        (
            x["model.remat"],
            x["model.scan_layers"],
            x["mesh.fsdp"],
            x["mesh.data"],
            x["mesh.context"],
            x["train.microbatch"],
        )
        for x in _tiny_tune_grid()
    ]
    want = {
        (rm, scan, f, 1 if f == -1 else -1, 1, 8)
        for rm in ("full", "dots", "attention", "none")
        for scan in (True, False)
        for f in (1, -1)
    }
    assert sorted(got, key=str) == sorted(want, key=str), got


@pytest.mark.slow
@needs_aot
def test_tune_lists_the_settings_that_fit_best_bound_first_and_writes_the_best(tmp_path, monkeypatch):
    """`compile --tune --tune_write` on the tiny config for 8 H100s, three settings of its grid (the grid itself:
    the test above; each setting is an H100 compile of its own): each fitting setting with its memory and bound,
    best first, the best one's overrides written."""
    import json

    from commands import run_command

    from resformer_jax.compilation import aot

    grid = _tiny_tune_grid()
    picked = [x for x in grid if (x["model.remat"], x["model.scan_layers"], x["mesh.fsdp"]) in
              {("full", True, -1), ("none", True, 1), ("dots", False, -1)}]  # fmt: skip
    assert len(picked) == 3
    monkeypatch.setattr(aot, "tune_candidates", lambda cfg, devices: picked if devices == 8 else [])
    out = tmp_path / "best.txt"
    r = run_command("compile", "--config=configs/tiny.py", "--target=h100x8", "--tune", f"--tune_write={out}")
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads(r.stdout.strip().splitlines()[-1])["results"]
    assert sorted((x["overrides"] for x in results), key=str) == sorted(picked, key=str)
    bounds = [x["bound_s"] for x in results if x["fits"]]
    assert bounds and bounds == sorted(bounds) and all(b > 0 for b in bounds)
    best = results[0]
    assert out.read_text().strip() == " ".join(f"--config.{k}={v}" for k, v in best["overrides"].items())
    assert "best for 8x NVIDIA H100 SXM 80GB" in r.stderr and "not a timing" in r.stderr


GATHER_HLO = """HloModule g

%fused_pick (param_0: f32[1024,4096], param_1: s32[1024,1]) -> f32[1024] {
  %param_0 = f32[1024,4096]{1,0} parameter(0)
  %param_1 = s32[1024,1]{1,0} parameter(1)
  %neg = f32[1024,4096]{1,0} negate(%param_0)
  %g = f32[1024,1]{1,0} gather(%neg, %param_1), offset_dims={}, collapsed_slice_dims={1}, start_index_map={1}, index_vector_dim=1, slice_sizes={1,1}
  ROOT %b = f32[1024]{0} bitcast(%g)
}

%fused_sum (param_0: f32[1024,4096]) -> f32[1024] {
  %param_0 = f32[1024,4096]{1,0} parameter(0)
  %zero = f32[] constant(0)
  ROOT %r = f32[1024]{0} reduce(%param_0, %zero), dimensions={1}, to_apply=%add
}

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

ENTRY %main (logits: f32[1024,4096], targets: s32[1024,1]) -> (f32[1024], f32[1024]) {
  %logits = f32[1024,4096]{1,0} parameter(0)
  %targets = s32[1024,1]{1,0} parameter(1)
  %pick = f32[1024]{0} fusion(%logits, %targets), kind=kLoop, calls=%fused_pick
  %sum = f32[1024]{0} fusion(%logits), kind=kInput, calls=%fused_sum
  ROOT %t = (f32[1024]{0}, f32[1024]{0}) tuple(%pick, %sum)
}
"""


def test_a_loop_fusion_reads_at_most_what_it_computes_a_reduction_reads_everything():
    """A loop fusion gathering one element per row (through an elementwise op) reads 1,024 of the 4M logits; a
    reduction over the same logits reads them all."""
    r = rl.roofline(GATHER_HLO, H100)
    pick = next(o for o in r.ops if o.name == "pick")
    assert pick.bytes == 4 * 1024 + 4 * 1024 + 4 * 1024  # one logit and one index per row read, one value written
    total = next(o for o in r.ops if o.name == "sum")
    assert total.bytes == 4 * 1024 * 4096 + 4 * 1024


def test_a_loop_whose_condition_is_a_fused_compare_counts_its_trips():
    """XLA:GPU prints no known_trip_count for some loops (the microbatch loop with the state sharded) and fuses the
    condition's `i < 8` into a fusion: the trip count is read inside it (counted once, the bound was 8x too low)."""
    text = HLO.replace(', backend_config={"known_trip_count":{"n":"8"}}', "").replace(
        "  ROOT %c = pred[] constant(true)\n}",
        "  %j = s32[] get-tuple-element(%p), index=0\n"
        "  ROOT %c = pred[] fusion(%j), kind=kLoop, calls=%fused_compare\n}\n\n"
        "%fused_compare (param_0: s32[]) -> pred[] {\n"
        "  %param_0 = s32[] parameter(0)\n"
        "  %eight = s32[] constant(8)\n"
        "  ROOT %lt = pred[] compare(%param_0, %eight), direction=LT\n}",
    )
    r = rl.roofline(text, H100)
    assert r.unknown_trip_counts == 0 and r.flops == 8 * 2 * 64 * 32 * 32


def test_the_costliest_computations_merge_an_ops_copies():
    """XLA clones an op per use (`fusion.12`, `fusion.12.clone`): the report's top rows are computations, each
    op's copies merged with their costs summed, not the same matmul ten times."""
    head = dict(kind="gemm", scope="lm_head/dot_general", flops=2e12, bytes=1e9)
    ops = [rl.OpCost(f"custom-call.{i}", executions=1, **head) for i in range(10)]
    ops.append(rl.OpCost("fusion.3", "fusion", "mlp/silu", 2, 1e9, 5e9))
    top = rl.Roofline(H100, ops, 0).top_computations()
    assert [r["scope"] for r in top] == ["lm_head/dot_general", "mlp/silu"]
    assert top[0]["copies"] == 10 and top[0]["executions"] == 10
    assert top[0]["bound_s"] == pytest.approx(10 * ops[0].bound_s(H100))


CUDNN_HLO = """HloModule m

ENTRY %main (q: bf16[4,2048,16,64], k: bf16[4,2048,4,64], v: bf16[4,2048,4,64], do: bf16[4,2048,16,64]) -> bf16[4,2048,16,64] {
  %q = bf16[4,2048,16,64]{3,2,1,0} parameter(0)
  %k = bf16[4,2048,4,64]{3,2,1,0} parameter(1)
  %v = bf16[4,2048,4,64]{3,2,1,0} parameter(2)
  %do = bf16[4,2048,16,64]{3,2,1,0} parameter(3)
  %f = (bf16[4,16,2048,64]{3,2,1,0}, f32[4,16,2048]{2,1,0}, u8[0]{0}) custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmax", backend_config={"cudnn_fmha_backend_config":{"mask_type":"CAUSAL"}}
  %o = bf16[4,16,2048,64]{3,2,1,0} get-tuple-element(%f), index=0
  %b = (bf16[4,2048,16,64]{3,2,1,0}, bf16[4,2048,4,64]{3,2,1,0}, bf16[4,2048,4,64]{3,2,1,0}, u8[0]{0}) custom-call(%q, %k, %v, %do), custom_call_target="__cudnn$fmhaSoftmaxBackward", backend_config={"cudnn_fmha_backend_config":{"mask_type":"CAUSAL"}}
  ROOT %dq = bf16[4,2048,16,64]{3,2,1,0} get-tuple-element(%b), index=0
}
"""


def test_cudnn_fused_attention_counts_its_causal_matmuls():
    r = rl.roofline(CUDNN_HLO, H100)
    pair = 2 * 4 * 16 * 2048 * 2048 * 64 / 2  # one causal [T, S] matmul over every head, 2 FLOPs a multiply-add
    fwd, bwd = (next(o for o in r.ops if o.name == n) for n in ("f", "b"))
    assert fwd.kind == bwd.kind == "kernel"
    assert fwd.flops == 2 * pair and bwd.flops == 5 * pair  # QK^T and PV; S recomputed, dP, dQ, dK, dV
    full = rl.roofline(CUDNN_HLO.replace('"CAUSAL"', '"NO_MASK"'), H100)
    assert next(o for o in full.ops if o.name == "f").flops == 4 * pair


def test_a_benchmarked_steps_bound_is_read_from_its_own_program():
    from resformer_jax.benchmarks.train import TrainBench
    from resformer_jax.presets import tiny_config

    b = TrainBench(tiny_config("resformer"), log=lambda m: None)
    assert b.bound() is None  # a CPU: no datasheet numbers to bound it with
    bound = b.bound(chip=H100)
    assert bound["chip"] == H100.kind and bound["per_op_bound_ms"] > 0
    parts = bound["by_part_ms"]
    assert set(parts) == {"gemm", "kernel", "fusion", "other", "collective"} and parts["fusion"] > 0
    assert sum(v for k, v in parts.items() if k != "collective") == pytest.approx(bound["per_op_bound_ms"], abs=0.05)


def test_tpu_prefetch_into_vmem_reads_its_slice_once_and_what_lands_on_the_core_is_not_hbm_traffic():
    """XLA:TPU prefetches a weight's pieces into VMEM (`S(1)`) with async slices, joins them with a ConcatBitcast
    and feeds the matmul from there: each piece read from HBM once, the join and the matmul's VMEM read free (counted
    as HBM traffic, the whole 16 MiB source a slice, they were 8 s of a 7B step's 13.4 s bound on v6e-64)."""
    text = """HloModule a

ENTRY %main (w: s8[4096], x: bf16[64,32]) -> bf16[64,32] {
  %w = s8[4096]{0:T(1024)} parameter(0)
  %x = bf16[64,32]{1,0:T(8,128)(2,1)} parameter(1)
  %s0 = ((s8[4096]{0:T(1024)}), s8[1024]{0:T(1024)S(1)}, s32[]{:S(2)}) slice-start(%w), slice={[0:1024]}
  %s1 = ((s8[4096]{0:T(1024)}), s8[1024]{0:T(1024)S(1)}, s32[]{:S(2)}) slice-start(%w), slice={[1024:2048]}
  %d0 = s8[1024]{0:T(1024)S(1)} slice-done(%s0)
  %d1 = s8[1024]{0:T(1024)S(1)} slice-done(%s1)
  %wv = bf16[32,32]{1,0:T(8,128)(2,1)S(1)} custom-call(%d0, %d1), custom_call_target="ConcatBitcast"
  %stack = bf16[15,64,32]{2,1,0:T(8,128)(2,1)} custom-call(), custom_call_target="AllocateBuffer"
  ROOT %y = bf16[64,32]{1,0:T(8,128)(2,1)} dot(%x, %wv), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}
"""
    r = rl.roofline(text, rl.chip_for("TPU v6e"))
    by = {o.name: o for o in r.ops}
    assert by["s0"].bytes == by["s1"].bytes == 1024  # the piece read; it lands in VMEM
    assert "d0" not in by and "stack" not in by and by["wv"].bytes == 0  # a join of VMEM pieces; an allocation
    assert by["y"].bytes == 2 * (2 * 64 * 32)  # x read and y written from HBM; the weight from VMEM
    gpu = rl.roofline(text, H100)  # a GPU has no VMEM: the same names in HBM
    assert {o.name: o.bytes for o in gpu.ops}["s0"] == 2 * 1024
