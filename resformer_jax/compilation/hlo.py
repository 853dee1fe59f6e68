"""The one reader of optimized HLO text (a compiled executable's `as_text()`): its computations, their
instructions (name, result shape, opcode, operands, attributes, the model scope they came from) and the bytes of
its shapes. The roofline (compilation/roofline.py) and the step profile (benchmarks/step_profile.py) read
programs with it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re

DTYPE_BYTES = {  # HLO's element types by width
    **dict.fromkeys(("s4", "u4"), 0.5),
    **dict.fromkeys(("pred", "s8", "u8"), 1),
    **dict.fromkeys(("s16", "u16", "f16", "bf16"), 2),
    **dict.fromkeys(("s32", "u32", "f32", "tf32"), 4),
    **dict.fromkeys(("s64", "u64", "f64", "c64"), 8),
    "c128": 16,
}
_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z]*)?)\[([0-9,]*)\]")
_LAID_ARRAY = re.compile(r"\b([a-z]+[0-9]*(?:e[0-9]m[0-9][a-z]*)?)\[([0-9,]*)\](\{[^}]*\})?")
_MEMORY_SPACE = re.compile(r"S\((\d+)\)")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%([^\s=]+)\s*=\s*(.*)$")
_HEADER = re.compile(r"^(ENTRY\s+)?%([^\s(]+)\s*\(.*\{\s*$")


def dtype_bytes(dtype: str) -> float:
    if dtype.startswith("f8"):
        return 1
    return DTYPE_BYTES.get(dtype, 0)


def arrays(shape: str) -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of every array in a (possibly tuple) HLO shape."""
    return [(d, tuple(int(x) for x in dims.split(",") if x)) for d, dims in _ARRAY.findall(shape)]


def shape_bytes(shape: str, off_hbm: frozenset[int] = frozenset()) -> float:
    """Bytes of every array in a (possibly tuple) HLO shape; those whose layout names a memory space in `off_hbm`
    (`S(1)`: a TPU's VMEM) left out."""
    total = 0.0
    for d, dims, layout in _LAID_ARRAY.findall(shape):
        space = _MEMORY_SPACE.search(layout)
        if space is None or int(space.group(1)) not in off_hbm:
            total += dtype_bytes(d) * math.prod(int(x) for x in dims.split(",") if x)
    return total


def elements(shape: str) -> int:
    """Elements of the largest array in a (possibly tuple) HLO shape."""
    return max((math.prod(dims) for _, dims in arrays(shape)), default=0)


@dataclasses.dataclass
class Instr:
    name: str
    shape: str  # the result's HLO shape
    opcode: str
    operands: list[str]
    attrs: str  # everything after the operand list
    arg: str = ""  # the operand list as written (a parameter's number)

    def attr_computations(self, key: str) -> list[str]:
        m = re.search(rf"\b{key}=\{{?([^}},]+(?:,\s*%[^}},]+)*)\}}?", self.attrs)
        return [c.strip().lstrip("%") for c in m.group(1).split(",")] if m else []

    @property
    def op_name(self) -> str:
        m = re.search(r'op_name="([^"]*)"', self.attrs)
        return m.group(1) if m else ""

    @property
    def backend_config(self) -> dict:
        start = self.attrs.find("backend_config={")
        try:  # the JSON object that starts there, wherever it ends
            return json.JSONDecoder().raw_decode(self.attrs, start + len("backend_config="))[0] if start >= 0 else {}
        except ValueError:
            return {}

    @property
    def custom_call_target(self) -> str:
        m = re.search(r'custom_call_target="([^"]+)"', self.attrs)
        return m.group(1) if m else ""


def _balanced(text: str, start: int) -> int:
    """Index just past the parenthesis that closes the one at `start`."""
    depth = 0
    for i in range(start, len(text)):
        if text[i] == "(":
            depth += 1
        elif text[i] == ")":
            depth -= 1
            if depth == 0:
                return i + 1
    return len(text)


def parse_instr(line: str) -> Instr | None:
    m = _INSTR.match(re.sub(r"/\*.*?\*/", "", line))
    if not m:
        return None
    name, rest = m.group(1), m.group(2).strip()
    if rest.startswith("("):
        end = _balanced(rest, 0)
        shape, rest = rest[:end], rest[end:].lstrip()
    else:
        shape, _, rest = rest.partition(" ")
    op = re.match(r"([\w\-$.]+)\(", rest)
    if not op:
        return None
    end = _balanced(rest, op.end() - 1)
    operands = re.findall(r"%([\w.\-$]+)", rest[op.end() : end - 1])
    return Instr(name, shape, op.group(1), operands, rest[end:].lstrip(", "), rest[op.end() : end - 1])


def _depth(text: str, depth: int = 0) -> int:
    """Open brackets ({ and ( ) left after `text`, outside double-quoted strings."""
    in_string = escaped = False
    for ch in text:
        if in_string:
            escaped = ch == "\\" and not escaped
            if ch == '"' and not escaped:
                in_string = False
            continue
        if ch == '"':
            in_string = True
        elif ch in "{(":
            depth += 1
        elif ch in "})":
            depth -= 1
    return depth


def parse_module(text: str) -> tuple[dict[str, list[Instr]], str]:
    """({computation: [instructions]}, the entry computation's name) of an HLO module's text. An instruction may
    span several lines (libtpu prints kernel metadata over many)."""
    comps: dict[str, list[Instr]] = {}
    entry, current, pending, depth = "", None, "", 0
    for line in text.splitlines():
        if pending:
            pending += "\n" + line
            depth = _depth(line, depth)
            if depth <= 0:
                ins = parse_instr(pending.replace("\n", " "))
                if ins is not None and current is not None:
                    comps[current].append(ins)
                pending = ""
            continue
        h = _HEADER.match(line)
        if h:
            current = h.group(2)
            comps[current] = []
            if h.group(1):
                entry = current
            continue
        if line.startswith("}"):
            current = None
            continue
        if current is not None and _INSTR.match(line):
            depth = _depth(line)
            if depth > 0:
                pending = line
                continue
            ins = parse_instr(line)
            if ins is not None:
                comps[current].append(ins)
    return comps, entry
