"""Where a train step's time goes, from a real profile: XLA's per-op timings of one step, grouped.

Its notes (the reasons, what was measured): docs/modules.md.
"""

from __future__ import annotations

import bisect
import dataclasses
import glob
import os
import re
import time

import jax

from resformer_jax.compilation.hlo import parse_module

GROUPS = ("matmul_projections_mlp", "attention", "lm_head_xent", "norms_elementwise", "optimizer", "host_overhead")
_SCOPES = (("optimizer", "optimizer"), ("lm_head_xent", "lm_head_xent"), ("attention_kernel", "attention"))
_CONTROL = ("while", "conditional", "call")
_MATMUL_OPS = ("dot", "convolution")


@dataclasses.dataclass(frozen=True)
class Instruction:
    opcode: str
    op_name: str
    calls: tuple[str, ...]
    target: str = ""  # a custom-call's target (cuBLAS's "__cublas$gemm", ...)


def parse_hlo(hlo_text: str) -> tuple[dict[str, Instruction], dict[str, set[str]]]:
    """{instruction name: Instruction} and {computation name: opcodes it holds} of an HLO module's text (read by
    compilation/hlo.py, the roofline's reader too).

    An instruction without a name scope of its own takes the scope of the instruction that calls its computation
    (ops XLA builds inside a loop body, e.g. under a `lax.map`, may carry no metadata)."""
    insts, comps = {}, {}
    computation_of: dict[str, str] = {}
    caller_of: dict[str, str] = {}
    module, _ = parse_module(hlo_text)
    for current, instrs in module.items():
        comps[current] = {ins.opcode for ins in instrs}
        for ins in instrs:
            calls = [
                c
                for key in ("calls", "to_apply", "body", "condition", "branch_computations")
                for c in ins.attr_computations(key)
            ]
            insts[ins.name] = Instruction(ins.opcode, ins.op_name, tuple(calls), ins.custom_call_target)
            computation_of[ins.name] = current
            for c in calls:
                caller_of.setdefault(c, ins.name)

    def scope(name, depth=0):
        inst = insts[name]
        caller = caller_of.get(computation_of[name])
        if inst.op_name or caller is None or depth > 64:
            return inst.op_name
        return scope(caller, depth + 1)

    return {n: i if i.op_name else dataclasses.replace(i, op_name=scope(n)) for n, i in insts.items()}, comps


# A GPU kernel whose HLO op the trace does not name (inside a CUDA-graph command buffer the event names only the
# buffer): its group by the kernel's own name. cuBLAS's GEMMs are nvjet/xmma/cutlass kernels; cuDNN's fused
# attention is an "sdpa" kernel with helpers in the cudnn:: namespace; ours are named in kernels/pallas_attention.
_LIBRARY_GEMM, _ATTENTION_MATMULS = "nvjet|gemm|xmma|cutlass|cublas", "sdpa|fmha|flash_attention"
_KERNEL_GROUPS = (
    (re.compile(f"{_ATTENTION_MATMULS}|cudnn::", re.I), "attention"),  # cudnn::: the fused attention's helpers
    (re.compile(_LIBRARY_GEMM, re.I), "matmul_projections_mlp"),
)
_GEMM_KERNEL = re.compile(f"{_LIBRARY_GEMM}|{_ATTENTION_MATMULS}", re.I)


def classify(inst: Instruction | None, comps: dict[str, set[str]], kernel: str = "") -> str:
    if inst is None:
        return next((group for pattern, group in _KERNEL_GROUPS if pattern.search(kernel)), "norms_elementwise")
    for scope, group in _SCOPES:
        if scope in inst.op_name:
            return group
    return "matmul_projections_mlp" if is_matmul(inst, comps) else "norms_elementwise"


def is_matmul(inst: Instruction | None, comps: dict[str, set[str]], kernel: str = "") -> bool:
    """A dot or convolution, a fusion around one, or a library GEMM (cuBLAS custom-calls); for a GPU kernel the
    trace ties to no HLO op, a GEMM or attention kernel by its name."""
    if inst is None:
        return bool(_GEMM_KERNEL.search(kernel))
    if inst.opcode == "custom-call" and re.search(r"gemm|matmul", inst.target, re.I):
        return True
    return inst.opcode in _MATMUL_OPS or any(
        comps.get(c, set()) & set(_MATMUL_OPS) for c in inst.calls if inst.opcode in ("fusion", "custom-call")
    )


def _is_op(name: str) -> bool:
    """An XLA op's event: not Python's ("$file:line fn"), the executor's ("A::B") or an end marker."""
    return not name.startswith(("$", "end:")) and "::" not in name


def _op_lines(profile):
    """The timelines holding XLA ops: a TPU's "XLA Ops" lines, a GPU's streams, else the CPU's worker threads."""
    device = [
        ln
        for p in profile.planes
        if p.name.startswith("/device:")
        for ln in p.lines
        if ln.name == "XLA Ops" or ln.name.startswith("Stream")
    ]
    if device:
        return device
    # XLA:CPU runs ops on its own thread pools (tf_XLAEigen/..., tf_XLAPjRtCpuClient/...); the Python thread's
    # events (jit dispatch, argument handling) are host overhead.
    host = [ln for p in profile.planes if p.name == "/host:CPU" for ln in p.lines]
    return [ln for ln in host if ln.name.startswith("tf_XLA")] or [ln for ln in host if ln.name != "python"]


_TASK_START, _TASK_STOP, _TASK_RECORD = (
    "ThreadpoolListener::StartRegion",
    "ThreadpoolListener::StopRegion",
    "ThreadpoolListener::Record",
)


def _line_ops(line, insts: dict[str, Instruction]) -> list[tuple[int, int, str]]:
    """A line's op events as (start, end, name). On a GPU stream each event is a kernel (or a memset/memcpy):
    its HLO op is the event's `hlo_op` stat where that names a leaf op of the module, else (a command buffer's
    kernels) the kernel's own name, which `classify` reads."""
    if line.name.startswith("Stream"):
        ops = []
        for e in line.events:
            if e.duration_ns > 0:
                op = _stat(e, "hlo_op")
                leaf = op in insts and insts[op].opcode not in _CONTROL
                ops.append((e.start_ns, e.start_ns + e.duration_ns, op if leaf else e.name))
        return ops
    return [
        (e.start_ns, e.start_ns + e.duration_ns, e.name) for e in line.events if e.duration_ns > 0 and _is_op(e.name)
    ]


def _stat(event, key):
    for k, v in getattr(event, "stats", ()):
        if k == key:
            return v
    return None


class _Innermost:
    """The latest-starting of a thread's (start, end, name) intervals that holds a time t, by bisection: a step
    has ~10^5 ops and thread-pool tasks on a CPU, and a scan per lookup took minutes."""

    def __init__(self, intervals):
        # by start; among equal starts the earlier-listed last, so the backward walk meets it first
        order = sorted(range(len(intervals)), key=lambda i: (intervals[i][0], -i))
        self.items = [intervals[i] for i in order]
        self.starts = [it[0] for it in self.items]
        self.reach, end = [], float("-inf")  # reach[i]: the latest end among items[:i + 1]
        for it in self.items:
            end = max(end, it[1])
            self.reach.append(end)

    def at(self, t):
        i = bisect.bisect_right(self.starts, t) - 1
        while i >= 0 and self.reach[i] > t:
            if self.items[i][1] > t:
                return self.items[i]
            i -= 1
        return None


def _thread_pool_tasks(lines, ops_by_line) -> list[list[tuple[int, int, str]]]:
    """Per line, the thread-pool tasks that run no op, as (start, end, name of the op that scheduled them).

    A task is a StartRegion..StopRegion pair on one thread with a context id `_c`; the Record event with the
    same id `_p` was emitted by whatever ran on the scheduling thread at that moment: an op (that op), or
    another task (whoever scheduled that task). Tasks that hold ops (the executor running thunks) or whose
    origin is not an op are left out: their time stays host overhead."""
    regions, records = [], {}  # per line: [(start, end, ctx)];  ctx -> (line index, time)
    op_index = [_Innermost(ops) for ops in ops_by_line]
    for li, line in enumerate(lines):
        mine, open_ = [], None
        for e in sorted(line.events, key=lambda e: e.start_ns):
            if e.name == _TASK_START:
                open_ = (e.start_ns, _stat(e, "_c"))
            elif e.name == _TASK_STOP and open_ is not None:
                mine.append((open_[0], e.start_ns, open_[1]))
                open_ = None
            elif e.name == _TASK_RECORD and _stat(e, "_p") is not None:
                records[_stat(e, "_p")] = (li, e.start_ns)
        # leaf tasks only: no op event starts inside
        starts = op_index[li].starts
        regions.append(
            [
                (s, t, c)
                for s, t, c in mine
                if c is not None and bisect.bisect_left(starts, s) == bisect.bisect_left(starts, t)
            ]
        )
    task_index = [_Innermost(rs) for rs in regions]
    memo: dict = {}

    def origin(ctx, depth=0):
        """Name of the op on whose behalf task `ctx` ran (None when it is not an op's work)."""
        if ctx in memo or depth > 64:
            return memo.get(ctx)
        memo[ctx] = None
        if ctx in records:
            li, t = records[ctx]
            inner_op, inner_task = op_index[li].at(t), task_index[li].at(t)
            if inner_task is not None and (inner_op is None or inner_task[0] > inner_op[0]):
                memo[ctx] = origin(inner_task[2], depth + 1)
            elif inner_op is not None:
                memo[ctx] = inner_op[2]
        return memo[ctx]

    return [[(s, e, origin(c)) for s, e, c in rs if origin(c) is not None] for rs in regions]


def breakdown(profile, hlo_text: str, wall_s: float, top_ops: int = 10) -> dict:
    insts, comps = parse_hlo(hlo_text)
    self_ns = dict.fromkeys(GROUPS, 0.0)
    matmul_ns = 0.0  # every group's matmuls (projections, attention's, the LM head's)
    by_op: dict[str, float] = {}
    intervals, unknown = [], 0
    lines = _op_lines(profile)
    ops_with_control = [_line_ops(line, insts) for line in lines]
    is_work = lambda n: n not in insts or insts[n].opcode not in _CONTROL
    ops_by_line = [[op for op in ops if is_work(op[2])] for ops in ops_with_control]
    tasks_by_line = _thread_pool_tasks(lines, ops_by_line)
    for ops, tasks in zip(ops_with_control, tasks_by_line):
        events = sorted(ops + tasks, key=lambda x: (x[0], -x[1]))
        stack: list[list] = []  # [end, name, child time]

        def close(item):
            end, name, start, child = item
            own = (end - start) - child
            inst = insts.get(name)
            if inst is not None and inst.opcode in _CONTROL:
                return  # a loop's own time is control flow: counted as host overhead below
            nonlocal unknown, matmul_ns
            unknown += inst is None
            self_ns[classify(inst, comps, name)] += max(own, 0.0)
            matmul_ns += max(own, 0.0) if is_matmul(inst, comps, name) else 0.0
            by_op[name] = by_op.get(name, 0.0) + max(own, 0.0)

        for start, end, name in events:
            while stack and stack[-1][0] <= start:
                close(stack.pop())
            if stack:
                stack[-1][3] += end - start
            inst = insts.get(name)
            if inst is None or inst.opcode not in _CONTROL:
                intervals.append((start, end))
            stack.append([end, name, start, 0.0])
        while stack:
            close(stack.pop())
    # Time in which any op other than loop control ran (the union over threads).
    busy, cur_s, cur_e = 0.0, 0.0, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                busy += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        busy += cur_e - cur_s
    ops_total = sum(self_ns.values())
    wall_ns = wall_s * 1e9
    busy = min(busy, wall_ns)
    scale = busy / ops_total if ops_total else 0.0
    out = {g: self_ns[g] * scale / 1e9 for g in GROUPS if g != "host_overhead"}
    out["host_overhead"] = (wall_ns - busy) / 1e9
    return {
        "seconds": {g: round(out[g], 9) for g in GROUPS},
        "fraction": {g: round(out[g] / wall_s, 4) for g in GROUPS},
        "profiled_step_s": round(wall_s, 9),
        # the part of the groups that matmuls took, scaled like them: what the step would take if nothing else ran
        "matmul_s": round(matmul_ns * scale / 1e9, 9),
        "op_time_over_busy_time": round(ops_total / busy, 3) if busy else None,
        "ops_not_in_hlo": unknown,
        # the ten ops that took longest (own time, before the overlap scaling), with where they came from
        "top_ops": [
            {
                "op": n,
                "group": classify(insts.get(n), comps, n),
                "seconds": round(t / 1e9, 9),
                "source": insts[n].op_name if n in insts else "",
            }
            for n, t in sorted(by_op.items(), key=lambda x: -x[1])[:top_ops]
        ],
    }


@dataclasses.dataclass
class ProfiledStep:
    state: object
    metrics: object
    breakdown: dict
    trace_dir: str


def profile_step(step_fn, state, tokens, hlo_text: str, profile_dir: str) -> ProfiledStep:
    """Runs one step under the profiler, writes the trace to profile_dir and returns the grouped breakdown."""
    os.makedirs(profile_dir, exist_ok=True)
    # No Python tracer: it records every Python call of the dispatch, which slows a small step; XLA's
    # own op events come from the host tracer.
    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0
    options.host_tracer_level = 1
    with jax.profiler.trace(profile_dir, profiler_options=options):
        t = time.perf_counter()
        state, metrics = step_fn(state, tokens)
        jax.block_until_ready(metrics)
        wall = time.perf_counter() - t
    # The profiler names a trace by the second it started: give each profiled step its own profile_dir.
    new = sorted(glob.glob(os.path.join(profile_dir, "**", "*.xplane.pb"), recursive=True), key=os.path.getmtime)
    if not new:
        raise RuntimeError(f"jax.profiler wrote no .xplane.pb under {profile_dir}")
    profile = jax.profiler.ProfileData.from_file(new[-1])
    return ProfiledStep(state, metrics, breakdown(profile, hlo_text, wall), os.path.dirname(new[-1]))
