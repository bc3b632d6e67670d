"""The dataflow of a compiled kernel's stored values, read from its PTX: for each value a global
store writes, a hash of the tree of operations that computed it (floating-point operations,
conversions, warp shuffles and their lane masks, shared-memory round trips), with every load
from global memory a leaf named by the pointer parameters its address came from, and integer
and address arithmetic reduced to the parameters and special registers it came from. Two
kernels whose stored values have the same hashes compute them by the same operations in the
same order, whatever their registers, their instruction schedule or their loops
(tests/test_kernels_compile.py compares the exact rows' attention with the one-row kernel).

PTX registers are virtual and mostly assigned once, wherever the block that assigns them lies
in the text. A register assigned more than once (a loop's carried value) is read as its latest
assignment before the read in the text, or its first one if none comes before: the same choice
in both kernels compared, since it depends only on where the loops are."""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from functools import cache

_INSTR = re.compile(r"^(@!?%\w+\s+)?([a-z][\w.:]*)\s*(.*?);?$")
_REG = re.compile(r"%[\w.]+")
_FLOAT = ("f32", "f16", "bf16", "e4m3", "e5m2")  # in an opcode: it works on values


def _operands(text: str) -> list[str]:
    """Comma-separated operands, a {..} vector or [..] address kept as one."""
    out, depth, cur = [], 0, ""
    for ch in text:
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        if ch == "," and depth == 0:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return [*out, cur.strip()] if cur.strip() else out


def _h(*parts) -> str:
    return hashlib.sha1(repr(parts).encode()).hexdigest()[:16]


def _instructions(ptx: str) -> list[tuple[str, list[str]]]:
    start = ptx.index("{", ptx.index(".entry"))
    out = []
    for line in ptx[start + 1 :].splitlines():
        line = line.split("//")[0].strip()
        if line.startswith(".section"):
            break
        m = _INSTR.match(line) if line and not line.startswith((".", "$", "{", "}")) else None
        if m:
            out.append((m.group(2), _operands(m.group(3))))
    return out


def _defined(opcode: str, ops: list[str]) -> list[str]:
    """The registers an instruction assigns (none for stores, branches, barriers)."""
    if not ops or opcode.startswith(("st.", "bra", "bar", "ret", "griddep", "red.", "atom.")):
        return []
    return _REG.findall(ops[0])


def stored_values(ptx: str, names: list[str] | None = None, into: str | None = None) -> Counter:
    """The hashes of the values the kernel's global stores write (a multiset); with `into`,
    only of those stored through that pointer parameter. `names`: the kernel's parameter
    names in order, so that loads are named alike across kernels (else by position)."""
    pointers = set(re.findall(r"\.param \.u64 \.ptr[\w .]*?(\w+_param_\d+)", ptx))
    if names:
        rename = {p: names[int(p.rsplit("_", 1)[1])] for p in pointers}
        for p in sorted(pointers, key=lambda p: -int(p.rsplit("_", 1)[1])):
            ptx = ptx.replace(p, rename[p])
        pointers = set(rename.values())
    code = _instructions(ptx)
    defs: dict[str, list[int]] = {}
    for i, (opcode, ops) in enumerate(code):
        for reg in _defined(opcode, ops):
            defs.setdefault(reg, []).append(i)
    shared_stores = [i for i, (opcode, _) in enumerate(code) if opcode.startswith("st.shared")]

    def reaching(reg: str, at: int) -> int | None:
        ds = defs.get(reg)
        if not ds:
            return None
        before = [d for d in ds if d < at]
        d = before[-1] if before and len(ds) > 1 else ds[0]
        after = [e for e in ds if d < e <= d + 8]
        if code[d][0].startswith("mov") and after and code[after[0]][0].startswith("ld."):
            return after[0]  # a masked load: the default it keeps where masked, then the load
        return d

    tracing: set[int] = set()

    @cache
    def origin(reg: str, at: int) -> frozenset:
        """The parameters and special registers an integer register's value came from."""
        d = reaching(reg, at)
        if d is None:
            return frozenset([reg])  # %tid.x, %ctaid.x, ...
        opcode, ops = code[d]
        if opcode.startswith("ld.param"):
            return frozenset([ops[1].strip("[]")])
        if opcode.startswith("ld.global"):  # data, not an address: which tensor it is from
            address = _REG.findall(ops[1])
            return frozenset(["loaded", *(p for p in origin(address[0], d) if p in pointers)])
        if d in tracing:  # carried round a loop, met again
            return frozenset()
        tracing.add(d)
        try:
            return frozenset().union(*(origin(r, d) for o in ops[1:] for r in _REG.findall(o)))
        finally:
            tracing.discard(d)

    visiting: set[int] = set()
    leaves: set[str] = set()  # the hashes that name loads

    @cache
    def value(op: str, at: int) -> str:
        if not op.startswith("%"):
            return _h("const", op)  # immediates: float bits, lane masks, offsets
        d = reaching(op, at)
        if d is None:
            return _h("int", sorted(origin(op, at)))
        if d in visiting:  # a value carried round a loop, met again
            return _h("carried")
        visiting.add(d)
        try:
            return _value_at(op, d, at)
        finally:
            visiting.discard(d)

    def _value_at(op: str, d: int, at: int) -> str:
        opcode, ops = code[d]
        outs = _defined(opcode, ops)
        part = outs.index(op)
        if opcode.startswith("ld.global"):
            address = _REG.findall(ops[1])
            tensors = sorted(p for p in origin(address[0], d) if p in pointers)
            # which tensor, not which element or how wide: vector loads vary in both
            leaf = _h("load", tensors)
            leaves.add(leaf)
            return leaf
        if opcode.startswith("ld.shared"):
            prior = [s for s in shared_stores if s < d]
            if not prior:
                return _h("shared", "?")
            stored = _REG.findall(code[prior[-1]][1][1])
            return _h("shared", value(stored[part % len(stored)], prior[-1]))
        if opcode.startswith("mov") and ops[0].startswith("{"):  # unpack into halves
            src = value(ops[1], d)  # which half is which element: not followed, as loads
            return src if src in leaves else _h("half", src)
        if opcode.startswith("mov") and ops[1].startswith("{"):  # pack halves
            return _h("pack", *(value(r, d) for r in _REG.findall(ops[1])))
        if opcode.startswith("mov") and len(ops) == 2:
            return value(ops[1], d)
        sources = [value(o, d) for o in ops[1:]]
        floating = any(t in opcode for t in _FLOAT)
        if floating and opcode.startswith(("add.", "mul.", "fma.", "max.", "min.")):
            # a + b is b + a and a * b + c is b * a + c, bit for bit (IEEE 754)
            sources[:2] = sorted(sources[:2])
        if floating or opcode.startswith(("shfl.", "selp.")):
            return _h(opcode, *sources)
        return _h("int", sorted(origin(op, at)))

    stores: Counter = Counter()
    for i, (opcode, ops) in enumerate(code):
        if not opcode.startswith("st.global"):
            continue
        if into is not None and into not in origin(_REG.findall(ops[0])[0], i):
            continue
        for reg in _REG.findall(ops[1]):
            stores[value(reg, i)] += 1
    return stores
