"""The compiled program's own bound on step time: every op XLA kept, its FLOPs and HBM bytes, and the time it
cannot beat on the chip (its roofline), summed. A bound from the program, not a timing: no device ran it.

Its notes (the reasons, what was measured): docs/modules.md.
"""

from __future__ import annotations

import dataclasses
import math
import re

from resformer_jax.chips import Chip, chip_named, chip_of_device
from resformer_jax.compilation.hlo import Instr, arrays, dtype_bytes, elements, parse_module, shape_bytes
from resformer_jax.kernels import pallas_attention, tpu_attention

FREE = {
    "parameter",
    "get-tuple-element",
    "tuple",
    "bitcast",
    "constant",
    "after-all",
    "partition-id",
    "replica-id",
    "opt-barrier",
    "add-dependency",
    "iota",
    "copy-done",
    "slice-done",
    "all-gather-done",
    "all-reduce-done",
    "reduce-scatter-done",
    "all-to-all-done",
    "collective-permute-done",
    "async-done",
    "async-update",
    "send-done",
    "recv-done",
    "get-dimension-size",
}
TPU_ON_CORE_SPACES = frozenset({1, 2})
_S8_ARRAY = re.compile(r"\bs8\[[0-9,]*\](\{[^}]*\})?")
_SLICE = re.compile(r"slice=\{([^}]*)\}")
_SLICE_DIM = re.compile(r"\[(\d+):(\d+)(?::(\d+))?\]")
COLLECTIVES = {
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "collective-permute",
    "all-reduce-start",
    "all-gather-start",
    "reduce-scatter-start",
    "all-to-all-start",
    "collective-permute-start",
    "ragged-all-to-all",
    "collective-broadcast",
}
GEMM_TARGETS = ("__cublas$gemm", "__cublas$lt$matmul", "__cublas$lt$matmul$f8")


# Ops that read more than one element of an operand per result element: a loop fusion holding one is not bounded
# by its result's size.
# Fusion roots that write into their first operand's buffer (donated or aliased): a paged cache's scatter of this
# step's tokens, a dense cache's dynamic-update-slice. They move the update, not the buffer.
IN_PLACE_UPDATES = ("dynamic-update-slice", "scatter")
LOOP_READERS = ("reduce", "reduce-window", "convolution", "dot", "scatter", "sort", "select-and-scatter", "fusion")


@dataclasses.dataclass
class OpCost:
    """One op of the program, summed over its executions."""

    name: str
    kind: str  # gemm | kernel | fusion | collective | other
    scope: str  # the model scope it came from (its op_name)
    executions: int
    flops: float
    bytes: float

    def bound_s(self, chip: Chip) -> float:
        return max(self.flops / chip.peak_flops, self.bytes / chip.hbm_bytes_per_s)


@dataclasses.dataclass
class Roofline:
    chip: Chip
    ops: list[OpCost]
    unknown_trip_counts: int  # while loops without a known trip count (counted once)

    def _total(self, kinds, attr):
        return sum(getattr(o, attr) for o in self.ops if o.kind in kinds)

    @property
    def flops(self) -> float:
        return self._total(("gemm", "kernel", "fusion", "other"), "flops")

    @property
    def hbm_bytes(self) -> float:
        return self._total(("gemm", "kernel", "fusion", "other"), "bytes")

    @property
    def collective_bytes(self) -> float:
        return self._total(("collective",), "bytes")

    @property
    def per_op_bound_s(self) -> float:
        return sum(o.bound_s(self.chip) for o in self.ops if o.kind != "collective")

    @property
    def program_bound_s(self) -> float:
        return max(self.flops / self.chip.peak_flops, self.hbm_bytes / self.chip.hbm_bytes_per_s)

    def by_kind(self) -> dict:
        out = {}
        for kind in ("gemm", "kernel", "fusion", "other", "collective"):
            ops = [o for o in self.ops if o.kind == kind]
            out[kind] = {
                "executions": sum(o.executions for o in ops),
                "flops": sum(o.flops for o in ops),
                "bytes": sum(o.bytes for o in ops),
                "bound_s": (
                    sum(o.bytes for o in ops) / self.chip.link_bytes_per_s
                    if kind == "collective"
                    else sum(o.bound_s(self.chip) for o in ops)
                ),
            }
        return out

    def top(self, n: int = 10) -> list[OpCost]:
        return sorted((o for o in self.ops if o.kind != "collective"), key=lambda o: -o.bound_s(self.chip))[:n]

    def report(self, model_flops_per_device: float, model_6n_flops_per_device: float) -> dict:
        """JSON: totals, both bounds, the MFU ceilings they imply in both conventions, the costliest ops."""
        c = self.chip
        return {
            "label": "a bound from the compiled program (each op at the chip's datasheet peak or bandwidth), not a "
            "timing",
            "chip": {k: getattr(c, k) for k in ("kind", "peak_flops", "hbm_bytes_per_s", "link_bytes_per_s", "source")},
            "flops_per_device": self.flops,
            "hbm_bytes_per_device": self.hbm_bytes,
            "collective_bytes_per_device": self.collective_bytes,
            "per_op_bound_s": self.per_op_bound_s,
            "program_bound_s": self.program_bound_s,
            "model_flops_per_device": model_flops_per_device,
            "mfu_ceiling_model": model_flops_per_device / (self.per_op_bound_s * c.peak_flops),
            "mfu_ceiling_6n": model_6n_flops_per_device / (self.per_op_bound_s * c.peak_flops),
            "mfu_ceiling_model_program_bound": model_flops_per_device / (self.program_bound_s * c.peak_flops),
            "by_kind": self.by_kind(),
            "unknown_trip_counts": self.unknown_trip_counts,
            "top_ops": self.top_computations(),
        }

    def top_computations(self, n: int = 10) -> list[dict]:
        """The costliest non-collective ops, the copies of one computation (same kind and model scope: XLA clones
        an op per use, `fusion.12`, `fusion.12.clone`) merged into one row with their summed cost."""
        merged: dict[tuple, dict] = {}
        for o in self.ops:
            if o.kind == "collective":
                continue
            key = (o.kind, o.scope or re.sub(r"(\.clone)?(\.\d+)*$", "", o.name), o.flops, o.bytes)
            first = dict(name=o.name, kind=o.kind, scope=o.scope, executions=0, flops=o.flops, bytes=o.bytes)
            row = merged.setdefault(key, {**first, "bound_s": 0.0, "copies": 0})
            row["executions"] += o.executions
            row["bound_s"] += o.bound_s(self.chip)
            row["copies"] += 1
        return sorted(merged.values(), key=lambda r: -r["bound_s"])[:n]


def dot_flops(ins: Instr, shapes: dict[str, str], contracting_key: str = "lhs_contracting_dims") -> float:
    """2 x (result elements) x (lhs contracting size): a dot's or GEMM's multiply-adds, twice."""
    out = arrays(ins.shape)
    lhs = arrays(shapes.get(ins.operands[0], "")) if ins.operands else []
    if not out or not lhs:
        return 0.0
    cfg = ins.backend_config.get("gemm_backend_config", {}).get("dot_dimension_numbers")
    if cfg is not None:
        contracting = [int(x) for x in cfg.get("lhs_contracting_dimensions", [])]
    else:
        m = re.search(rf"{contracting_key}=\{{([0-9,]*)\}}", ins.attrs)
        contracting = [int(x) for x in m.group(1).split(",") if x] if m else []
    k = math.prod(lhs[0][1][d] for d in contracting if d < len(lhs[0][1]))
    return 2.0 * math.prod(out[0][1]) * k


def _taps(I: int, W: int, O: int, lo: int, stride: int = 1, lhs_dil: int = 1, rhs_dil: int = 1) -> int:
    """(output position, window position) pairs of one spatial dimension that read a real input element, not
    padding or a dilation hole."""
    if stride == 1 and lhs_dil == 1 and rhs_dil == 1:
        return sum(max(0, min(O, I + lo - w) - max(0, lo - w)) for w in range(W))
    span = (I - 1) * lhs_dil + 1
    return sum(
        1
        for w in range(W)
        for o in range(O)
        if 0 <= o * stride + w * rhs_dil - lo < span and (o * stride + w * rhs_dil - lo) % lhs_dil == 0
    )


def conv_flops(ins: Instr, shapes: dict[str, str]) -> float:
    """A convolution's multiply-adds, twice, counting only window taps on real input: libtpu writes dots as
    convolutions whose spatial dimensions are padded so that one tap per output is real (a window of 16 over an
    input of 1 padded by 15 on each side is a batch of 16, not 16 times the work)."""
    out = arrays(ins.shape)
    lhs = arrays(shapes.get(ins.operands[0], "")) if ins.operands else []
    rhs = arrays(shapes.get(ins.operands[1], "")) if len(ins.operands) > 1 else []
    labels = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins.attrs)
    if not out or not lhs or not rhs or not labels:
        return 0.0
    l_lab, r_lab, o_lab = labels.groups()
    l_dims, r_dims, o_dims = lhs[0][1], rhs[0][1], out[0][1]
    window = re.search(r"window=\{([^}]*)\}", ins.attrs)
    fields = dict(kv.split("=", 1) for kv in window.group(1).split()) if window else {}

    def per_dim(key: str, n: int, default: int) -> list:
        return [int(x) for x in fields[key].split("x")] if key in fields else [default] * n

    spatial = sorted(ch for ch in o_lab if ch.isdigit())
    n = len(spatial)
    pads = [tuple(int(x) for x in p.split("_")) for p in fields["pad"].split("x")] if "pad" in fields else [(0, 0)] * n
    strides, lhs_dil, rhs_dil = per_dim("stride", n, 1), per_dim("lhs_dilate", n, 1), per_dim("rhs_dilate", n, 1)
    taps = 1
    for k, d in enumerate(spatial):
        sizes = (l_dims[l_lab.index(d)], r_dims[r_lab.index(d)], o_dims[o_lab.index(d)])
        taps *= _taps(*sizes, pads[k][0], strides[k], lhs_dil[k], rhs_dil[k])
    outer = math.prod(o_dims[i] for i, ch in enumerate(o_lab) if not ch.isdigit())  # batch x output features
    return 2.0 * outer * r_dims[r_lab.index("i")] * taps


def kernel_flops(ins: Instr, shapes: dict[str, str], device_kind: str = "", documents=None) -> float:
    """A Pallas kernel's FLOPs by its own formula, where the project knows the kernel: the GPU kernels by the
    pallas_call name in op_name (q [B, T, H, D], k [B, S, K, D]), splash on TPU by the custom call's name
    (q [N, G, T, D], k [N, S, D]); 0 for a kernel it does not know."""
    known = [(n, pallas_attention, ins.op_name) for n, _ in pallas_attention.KERNEL_MATMULS] + [
        (n, tpu_attention, ins.name) for n, _ in tpu_attention.KERNEL_MATMULS
    ]
    for name, module, where in known:
        if name not in where:
            continue
        q, k = (
            (arrays(shapes.get(o, "")) for o in ins.operands[:2])
            if module is pallas_attention
            else (arrays(shapes.get(o, "")) for o in ins.operands[2:4])
        )
        if not q or not k:
            return 0.0
        if module is pallas_attention and len(q[0][1]) == 4 and len(k[0][1]) == 4:
            tables, rope = name + pallas_attention.TABLES in where, pallas_attention.ROPE in where
            itemsize = dtype_bytes(q[0][0])
            return module.kernel_flops(
                name, q[0][1], k[0][1], itemsize, device_kind=device_kind, documents=documents, tables=tables, rope=rope
            )
        if module is tpu_attention and len(q[0][1]) >= 3 and len(k[0][1]) >= 2:
            return module.kernel_flops(name, q[0][1], k[0][1])
    return 0.0


def cudnn_attention_flops(ins: Instr, shapes: dict[str, str]) -> float:
    """cuDNN's fused attention (`jax.nn.dot_product_attention(implementation="cudnn")`, q [B, T, H, D] and
    k [B, S, K, D] its first operands) by the attention formula: 2 matmuls forward, 5 backward (S recomputed, dP,
    dQ, dK, dV), causal at half. cuDNN's own blocking is not known here, so its skipped work is taken as exact."""
    q, k = (arrays(shapes.get(o, "")) for o in ins.operands[:2])
    if not q or not k or len(q[0][1]) != 4 or len(k[0][1]) != 4:
        return 0.0
    (B, T, H, D), S = q[0][1], k[0][1][1]
    matmuls = 5 if "Backward" in ins.custom_call_target else 2
    causal = 0.5 if "CAUSAL" in ins.attrs.upper() else 1.0
    return float(matmuls * 2 * B * H * T * S * D * causal)


class _Walker:
    def __init__(self, comps: dict[str, list[Instr]], device_kind: str = "", documents=None):
        self.comps, self.device_kind, self.documents = comps, device_kind, documents
        # a TPU's scoped memories (S(1) VMEM, S(2) semaphores) are on the core: reading them is not HBM traffic
        self.off_hbm = TPU_ON_CORE_SPACES if "TPU" in device_kind else frozenset()
        self.shapes = {i.name: i.shape for body in comps.values() for i in body}
        for body in comps.values():  # parameters are instructions too
            for i in body:
                if i.opcode == "parameter":
                    self.shapes[i.name] = i.shape
        self.by_name = {i.name: i for body in comps.values() for i in body}
        self.ops: dict[str, OpCost] = {}
        self.unknown_trips = 0

    def _add(self, ins: Instr, kind: str, n: int, flops: float, nbytes: float):
        o = self.ops.get(ins.name)
        if o is None:
            o = self.ops[ins.name] = OpCost(ins.name, kind, ins.op_name, 0, 0.0, 0.0)
        o.executions += n
        o.flops += n * flops
        o.bytes += n * nbytes

    def _bytes(self, shape: str) -> float:
        return shape_bytes(shape, self.off_hbm)

    def _async_slice_bytes(self, ins: Instr) -> float:
        """An async slice's HBM traffic: its slice read from the source, written where the slice is not on the core
        (XLA:TPU prefetching a weight's pieces into VMEM)."""
        source = self.shapes.get(ins.operands[0], "") if ins.operands else ""
        dims = _SLICE.search(ins.attrs)
        laid = arrays(source)
        if not laid or dims is None:
            return self._bytes(ins.shape)
        elements = math.prod(
            -(-(int(b) - int(a)) // int(step or 1)) for a, b, step in _SLICE_DIM.findall(dims.group(1))
        )
        piece = elements * dtype_bytes(laid[0][0])
        read = piece if self._bytes(source) else 0.0
        landed = [a for a in ins.shape.split("),", 1)[-1].split(", ") if "[" in a and "[]" not in a]
        written = piece if landed and self._bytes(landed[0]) else 0.0
        return read + written

    def _operand_bytes(self, ins: Instr) -> float:
        return sum(self._bytes(self.shapes.get(o, "")) for o in dict.fromkeys(ins.operands))

    def _fused_flops(self, comp: str) -> float:
        total = 0.0
        for i in self.comps.get(comp, []):
            if i.opcode == "dot":
                total += dot_flops(i, self.shapes)
            elif i.opcode == "convolution":
                total += conv_flops(i, self.shapes)
            elif i.opcode == "custom-call" and i.custom_call_target in GEMM_TARGETS:
                total += dot_flops(i, self.shapes)
            elif i.opcode == "fusion":
                total += sum(self._fused_flops(c) for c in i.attr_computations("calls"))
        return total

    def _sliced_reads(self, comp: str, param: str, depth: int = 0) -> float | None:
        """The bytes a fused computation reads of its parameter `param` where every use takes a slice of it
        (dynamic-slice, slice, gather), directly or through a nested fusion's parameter; None where a use reads it
        whole."""
        body = self.comps.get(comp, [])
        uses = [i for i in body if param in i.operands]
        if not uses or depth > 4:
            return None
        total = 0.0
        for u in uses:
            if u.opcode in ("dynamic-slice", "slice", "gather") and u.operands[0] == param:
                total += self._bytes(u.shape)
                continue
            if u.opcode != "fusion" or u.operands.count(param) != 1:
                return None
            inner = (u.attr_computations("calls") or [""])[0]
            inner_params = {
                int(i.arg): i.name for i in self.comps.get(inner, []) if i.opcode == "parameter" and i.arg.isdigit()
            }
            nested = self._sliced_reads(inner, inner_params.get(u.operands.index(param), ""), depth + 1)
            if nested is None:
                return None
            total += nested
        return total

    def _fusion_bytes(self, ins: Instr) -> float:
        """Operands read plus results written, where a fused slice reads only its slice (also inside a nested
        fusion) and a fused in-place update writes only its update (also beside other results of a tuple)."""
        called = (ins.attr_computations("calls") or [""])[0]
        body = self.comps.get(called, [])
        by_name = {i.name: i for i in body}
        params = {int(i.arg): i.name for i in body if i.opcode == "parameter" and i.arg.strip().isdigit()}
        root = body[-1] if body else None
        roots = [root] if root is not None else []
        if root is not None and root.opcode == "tuple":
            roots = [by_name[o] for o in root.operands if o in by_name]
        # a bitcast of an in-place update is that update
        roots = [by_name.get(r.operands[0], r) if r.opcode == "bitcast" and r.operands else r for r in roots]
        updates = [r for r in roots if r.opcode in IN_PLACE_UPDATES]
        if roots and updates:
            # an update's bytes: operand 1 of a dynamic-update-slice, the last operand of a (one-array) scatter
            written = sum(
                self._bytes(self.shapes.get(r.operands[1 if r.opcode == "dynamic-update-slice" else -1], ""))
                if r.opcode in IN_PLACE_UPDATES
                else self._bytes(r.shape)
                for r in roots
            )
        else:
            written = self._bytes(ins.shape)
        in_place = {r.operands[0] for r in updates}
        users: dict[str, list[Instr]] = {}
        for i in body:
            for o in i.operands:
                users.setdefault(o, []).append(i)
        # A loop fusion computes each result element once from elementwise ops, slices and gathers: it reads at
        # most as many elements of a parameter as it computes (a gather of one logit per row reads that logit).
        computed = None
        if "kind=kLoop" in ins.attrs and not any(i.opcode in LOOP_READERS for i in body):
            computed = max(
                (elements(self.shapes.get(r.operands[1], "") if r.opcode == "dynamic-update-slice" else r.shape))
                for r in roots
            )
        read = 0.0
        for n, operand in enumerate(ins.operands):
            p = params.get(n)
            uses = users.get(p, []) if p else []
            if p in in_place and all(u.opcode in IN_PLACE_UPDATES and u.operands[0] == p for u in uses):
                continue  # the buffer updated in place: only the update is written, nothing of it read
            sliced = self._sliced_reads(called, p) if p else None
            if sliced is not None:
                read += sliced
            else:
                shape = self.shapes.get(operand, "")
                whole = self._bytes(shape)
                read += (
                    whole if computed is None else min(whole, computed * max(dtype_bytes(d) for d, _ in arrays(shape)))
                )
        return read + written

    def _trip_count(self, ins: Instr) -> int:
        m = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', ins.attrs)
        if m:
            return int(m.group(1))
        n = self._counted_loop(ins)
        if n is not None:
            return n
        self.unknown_trips += 1
        return 1

    def _constant(self, name: str) -> int | None:
        """The integer a (copied) constant instruction holds."""
        i = self.by_name.get(name)
        while i is not None and i.opcode == "copy" and i.operands:
            i = self.by_name.get(i.operands[0])
        if i is not None and i.opcode == "constant" and re.fullmatch(r"-?\d+", i.arg.strip()):
            return int(i.arg)
        return None

    def _counted_loop(self, ins: Instr) -> int | None:
        """Trips of `while (i < C)` with i starting at a constant S and stepping by one (libtpu prints no
        known_trip_count): C - S."""
        cond = self.comps.get((ins.attr_computations("condition") or [""])[0], [])
        if not cond:
            return None
        by_name = {i.name: i for i in cond}
        compare = cond[-1]
        if compare.opcode == "fusion":  # XLA:GPU fuses the compare: read it inside, its parameters as the operands
            fused = self.comps.get((compare.attr_computations("calls") or [""])[0], [])
            inner = {i.name: i for i in fused}
            for i in fused:
                if i.opcode == "parameter" and i.arg.strip().isdigit() and int(i.arg) < len(compare.operands):
                    inner[i.name] = by_name.get(compare.operands[int(i.arg)], i)
            by_name, compare = inner, (fused[-1] if fused else compare)
        if compare.opcode != "compare" or "direction=LT" not in compare.attrs:
            return None
        index, bound = (by_name.get(o) for o in compare.operands[:2])
        if index is None or bound is None or index.opcode != "get-tuple-element" or bound.opcode != "constant":
            return None
        k = re.search(r"index=(\d+)", index.attrs)
        init = self.by_name.get(ins.operands[0]) if ins.operands else None
        if k is None or init is None or init.opcode != "tuple" or int(k.group(1)) >= len(init.operands):
            return None
        start = self._constant(init.operands[int(k.group(1))])
        limit = int(bound.arg) if re.fullmatch(r"-?\d+", bound.arg.strip()) else None
        return None if start is None or limit is None else max(0, limit - start)

    def cost_of(self, comp: str) -> float:
        """A computation's per-op bound on one chip-agnostic scale (bytes + FLOPs), to pick a conditional's branch."""
        sub = _Walker(self.comps, self.device_kind, self.documents)
        sub.walk(comp, 1)
        return sum(o.flops + o.bytes for o in sub.ops.values())

    def walk(self, comp: str, n: int):
        for ins in self.comps.get(comp, []):
            op = ins.opcode
            if op in FREE:
                continue
            if op == "while":
                body = ins.attr_computations("body")
                if body:
                    self.walk(body[0], n * self._trip_count(ins))
            elif op == "call":
                for c in ins.attr_computations("to_apply") or ins.attr_computations("calls"):
                    self.walk(c, n)
            elif op == "conditional":
                branches = ins.attr_computations("branch_computations") or ins.attr_computations(
                    "true_computation"
                ) + ins.attr_computations("false_computation")
                if branches:
                    self.walk(max(branches, key=self.cost_of), n)
            elif op in COLLECTIVES or op in ("send", "recv"):
                nbytes = max(self._bytes(ins.shape), self._operand_bytes(ins))
                self._add(ins, "collective", n, 0.0, nbytes)
            elif op == "async-start":
                called = ins.attr_computations("calls")
                inner = self.comps.get(called[0], []) if called else []
                if any(i.opcode in COLLECTIVES for i in inner):
                    self._add(ins, "collective", n, 0.0, self._operand_bytes(ins))
                elif called:
                    self.walk(called[0], n)
            elif op == "copy-start":  # (destination, source, context): each read or written where it is in HBM
                self._add(ins, "other", n, 0.0, self._bytes(ins.shape))
            elif op == "slice-start":  # ((source), slice, context): the slice read, and written where it lands in HBM
                self._add(ins, "other", n, 0.0, self._async_slice_bytes(ins))
            elif op == "fusion":
                flops = sum(self._fused_flops(c) for c in ins.attr_computations("calls"))
                self._add(ins, "gemm" if flops else "fusion", n, flops, self._fusion_bytes(ins))
            elif op == "custom-call":
                target = ins.custom_call_target
                nbytes = self._operand_bytes(ins) + self._bytes(_S8_ARRAY.sub("", ins.shape))  # s8: a workspace
                if target == "AllocateBuffer":  # XLA:TPU reserving a buffer (a scan's stack) touches no memory
                    pass
                elif target in GEMM_TARGETS:
                    self._add(ins, "gemm", n, dot_flops(ins, self.shapes), nbytes)
                elif "cudnn$fmha" in target:
                    self._add(ins, "kernel", n, cudnn_attention_flops(ins, self.shapes), nbytes)
                elif target in ("__gpu$xla.gpu.triton", "tpu_custom_call") or "cudnn" in target:
                    flops = kernel_flops(ins, self.shapes, self.device_kind, self.documents)
                    self._add(ins, "kernel", n, flops, nbytes)
                else:
                    self._add(ins, "other", n, 0.0, nbytes)
            elif op in ("dot", "convolution"):
                flops = (dot_flops if op == "dot" else conv_flops)(ins, self.shapes)
                self._add(ins, "gemm", n, flops, self._operand_bytes(ins) + self._bytes(ins.shape))
            elif op == "dynamic-update-slice":
                upd = self._bytes(self.shapes.get(ins.operands[1], "")) if len(ins.operands) > 1 else 0.0
                self._add(ins, "other", n, 0.0, 2 * upd)
            elif op in ("dynamic-slice", "slice"):
                self._add(ins, "other", n, 0.0, 2 * self._bytes(ins.shape))
            else:
                self._add(ins, "other", n, 0.0, self._operand_bytes(ins) + self._bytes(ins.shape))


def roofline(hlo_text: str, chip: Chip, documents=None) -> Roofline:
    """The roofline of an optimized HLO module (a compiled executable's as_text()). `documents` (rows of 1s at
    each packed document's end, perf.packed_documents): the Pallas GPU kernels' blocks counted as they skip them
    on that packing (the run masking documents); without, every causal block."""
    comps, entry = parse_module(hlo_text)
    w = _Walker(comps, chip.kind, documents)
    w.walk(entry, 1)
    return Roofline(chip, list(w.ops.values()), w.unknown_trips)


def chip_for(kind: str) -> Chip | None:
    """The chip a compile target's `kind` names, where the roofline knows its numbers."""
    chip = chip_named(kind)
    return chip if chip is not None and chip.has_roofline else None


def step_bound_line(hlo_text, device_kind: str, model_flops_per_device: float) -> str:
    """The trainer's start-up words on its compiled step's roofline on this machine's chip: the per-op bound and its
    MFU ceiling (a bound, not a timing); '' on a device without the roofline's numbers (a CPU). `hlo_text`: a
    callable giving the compiled step's HLO, read only where the chip is known."""
    chip = chip_of_device(device_kind)
    if chip is None or not chip.has_roofline:
        return ""
    bound = roofline(hlo_text(), chip).per_op_bound_s
    if not bound:
        return ""
    mfu = model_flops_per_device / (bound * chip.peak_flops)
    how = "from the compiled program, not a timing"
    return f"step bound {bound * 1e3:,.1f} ms on {chip.kind} (MFU ceiling {mfu:.3f}; {how})"
