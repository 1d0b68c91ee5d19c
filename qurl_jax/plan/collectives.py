"""The collectives a compiled program's loop runs per iteration, read from its optimized HLO text.

    hlo = jax.jit(f).lower(*args).compile().as_text()     # or a dump's *after_optimizations.txt
    found = collectives.loop_body_collectives(hlo)          # the decode loop: see `decode_loop`
    count, nbytes, by_kind = collectives.summarize(found)

A pure reader of text: nothing is compiled or run here. Programs compiled on a multi-device mesh
hold the collectives XLA's SPMD partitioner inserted; a one-device compile holds none, so read a
program compiled on the target's whole slice.

Which loop. A program may hold several `while` loops (the decode loop, an attention kernel's loop
over KV blocks inside it, a sampler's bisection). `decode_loop` picks the `while` whose body runs
the most dot / convolution instructions per iteration, counting the computations it calls
(fusions, calls, conditionals' branches, async wrappers) and the loops nested in it (each once,
not by trip count); a tie goes to the loop nested inside the other (an outer loop that only
wraps the decode loop ties with it). The decode step runs every matrix of the model; nothing else
in a sampler comes close. A caller that knows better names the loop: `while_name` (the `while`
instruction's name) or `body` (its body computation's name).

What is counted. Every all-gather, all-reduce, reduce-scatter, all-to-all (also ragged),
collective-permute and collective-broadcast in the loop's body and in the computations it calls;
an asynchronous pair (`all-gather-start` / `-done`, `async-start` wrapping a collective /
`async-done`) counts once, at its start. A collective inside a loop nested in the body (a
`while` with a known trip count) is listed once per trip; one of unknown trip count once.

Bytes. `Collective.bytes` is the collective's whole buffer on one device: the larger of its
operands' and its results' sizes (an all-gather's gathered result, a reduce-scatter's input, an
all-reduce's, all-to-all's or permute's operand), summed over the buffers of a combined (tuple)
collective: XLA's combiners merge, e.g., a layer's gate and up projections' all-reduces into one
`(s32[512,8960], s32[512,8960]) all-reduce(...)`. It is what the collective spans, not what
crosses a link; `Collective.link_bytes` is what one device sends by a ring (bandwidth-optimal)
algorithm over its group of n devices: all-gather and reduce-scatter (n-1)/n x bytes, all-reduce
2(n-1)/n x bytes, all-to-all (n-1)/n x bytes, collective-permute and collective-broadcast the
whole buffer. The roofline (`bench.roofline`) charges `link_bytes`.

The rollout-layout issue's figures for main are the first buffers of the collectives in the loop
body's own computation: `summarize(loop_body_collectives(hlo, follow_calls=False))
.first_buffer_bytes`. The 1.5B GRPO decode on tpu:v5p-16 (learner's fsdp-8 layout): "259
collectives, 673.7 MiB per token per device"; with every buffer the same 259 span 1261.7 MiB
(`Summary.bytes`), of which a ring sends 2189.6 MiB per device. The 7B DAPO decode on tpu:v5p-32
(fsdp 8 x tensor 2): "358 collectives, 148.1 MiB"; read in full, 387 collectives (29 more inside
libtpu's all-reduce-scatter fusions, an all-reduce and a dynamic slice each) spanning 327.7 MiB.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import re
from collections.abc import Iterable, Sequence

KINDS = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "ragged-all-to-all",
         "collective-permute", "collective-broadcast")

# Bytes per element of each HLO primitive type (sub-byte types as fractions).
DTYPE_BYTES: dict[str, float] = {
    "pred": 1, "s2": 0.25, "u2": 0.25, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2,
    "s32": 4, "u32": 4, "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8,
    "c128": 16, "f4e2m1fn": 0.5, "f8e8m0fnu": 1, "f8e4m3": 1, "f8e4m3fn": 1, "f8e4m3b11fnuz": 1,
    "f8e4m3fnuz": 1, "f8e5m2": 1, "f8e5m2fnuz": 1, "f8e3m4": 1, "token": 0,
}
_ARRAY = re.compile(r"\b([a-z][a-z0-9]*)\[([0-9,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([^\s(]+)\s*\(.*->.*\{\s*$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_OPCODE = re.compile(r"^\s*([a-z][a-z0-9\-]*)\(")
_CALLED_ONE = re.compile(
    r"\b(calls|to_apply|body|condition|true_computation|false_computation)=%?([\w.\-]+)")
_CALLED_MANY = re.compile(r"\b(calls|branch_computations|called_computations)=\{([^}]*)\}")
_METADATA = re.compile(r",?\s*metadata=\{[^}]*\}")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_MATMULS = ("dot", "convolution", "ragged-dot")
_NOT_FOLLOWED = ("async-update", "async-done")  # their callee is the async-start's, counted once


class HloError(ValueError):
    """HLO text that holds no loop to read, or not the one named."""


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a loop's body, per iteration, per device.

    kind: its HLO opcode without an async suffix ('all-reduce', ...); dtype and shape: of its
    largest buffer (for a combined, tuple-shaped collective the largest of its buffers; `shape`
    as a tuple of ints); bytes: its whole buffer on one device (module docstring), every buffer
    of a combined collective; group: the devices in each of its replica groups (0 where the text
    does not say, e.g. a permute); name: its instruction's name, for finding it in the text."""

    kind: str
    dtype: str
    shape: tuple[int, ...]
    bytes: int
    group: int = 0
    name: str = ""
    buffers: tuple[tuple[str, tuple[int, ...], int], ...] = ()  # (dtype, shape, bytes) each

    @property
    def first_buffer_bytes(self) -> int:
        """Bytes of its first buffer only (module docstring: how the issue's figure read a
        combined collective)."""
        return self.buffers[0][2] if self.buffers else self.bytes

    @property
    def link_bytes(self) -> float:
        """Bytes one device sends by a ring algorithm over its group (module docstring)."""
        n = self.group
        if self.kind in ("collective-permute", "collective-broadcast") or n <= 1:
            return float(self.bytes) if n != 1 else 0.0
        share = (n - 1) / n
        return self.bytes * share * (2 if self.kind == "all-reduce" else 1)

    def describe(self) -> str:
        dims = ",".join(map(str, self.shape))
        return (f"{self.kind} {self.dtype}[{dims}] ({self.bytes / 2**20:.2f} MiB, "
                f"group {self.group})")


@dataclasses.dataclass(frozen=True)
class _Instruction:
    name: str
    type: str  # its result type text: 'f32[2,64]{1,0}' or a tuple '(s8[..], s8[..])'
    opcode: str
    operands: tuple[str, ...]
    called: tuple[str, ...]
    attrs: str  # the text after the operand list


@dataclasses.dataclass(frozen=True)
class Module:
    """An HLO module's computations: name -> its instructions in text order."""

    computations: dict[str, list[_Instruction]]
    entry: str

    def types(self, computation: str) -> dict[str, str]:
        return {i.name: i.type for i in self.computations[computation]}


def _split_type(rest: str) -> tuple[str, str]:
    """(the leading result type, what follows) of an instruction's right-hand side."""
    rest = rest.lstrip()
    if not rest.startswith("("):
        end = rest.find(" ")
        return rest[:end], rest[end:]
    depth = 0
    for i, ch in enumerate(rest):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if depth == 0:
            return rest[:i + 1], rest[i + 1:]
    raise HloError(f"unbalanced tuple type in HLO: {rest[:80]!r}")


def _operands_and_attrs(rest: str) -> tuple[tuple[str, ...], str]:
    """The operand names inside an instruction's outermost parentheses, and the text after."""
    depth, start = 0, rest.index("(")
    for i in range(start, len(rest)):
        depth += {"(": 1, ")": -1, "{": 1, "}": -1}.get(rest[i], 0)
        if depth == 0:
            inside = rest[start + 1:i]
            return tuple(re.findall(r"%([\w.\-]+)", inside)), rest[i + 1:]
    raise HloError(f"unbalanced operand list in HLO: {rest[:80]!r}")


def parse(hlo_text: str) -> Module:
    """The computations of an HLO module's text (`Compiled.as_text()`, or a dump's
    `*after_optimizations.txt`)."""
    computations: dict[str, list[_Instruction]] = {}
    entry, current = "", None
    for line in hlo_text.splitlines():
        if current is None:
            header = _HEADER.match(line)
            if header and not line.startswith("HloModule"):
                current = header.group(2).lstrip("%")
                computations[current] = []
                if header.group(1):
                    entry = current
            continue
        if line.strip() == "}":
            current = None
            continue
        m = _INSTRUCTION.match(line)
        if not m:
            continue
        type_text, rest = _split_type(m.group(2))
        op = _OPCODE.match(rest)
        if not op:
            continue
        operands, attrs = _operands_and_attrs(rest)
        attrs = _METADATA.sub("", attrs)
        called = [c for _, c in _CALLED_ONE.findall(attrs)]
        for _, many in _CALLED_MANY.findall(attrs):
            called += [c.strip().lstrip("%") for c in many.split(",") if c.strip()]
        computations[current].append(_Instruction(
            m.group(1).lstrip("%"), type_text, op.group(1), operands, tuple(called), attrs))
    if not computations:
        raise HloError("no HLO computation in the text")
    return Module(computations, entry)


def arrays(type_text: str) -> list[tuple[str, tuple[int, ...], int]]:
    """(dtype, shape, bytes) of every array in a (possibly tuple) type."""
    out = []
    for dtype, dims in _ARRAY.findall(type_text):
        if dtype not in DTYPE_BYTES:
            continue
        shape = tuple(int(d) for d in dims.split(",") if d)
        out.append((dtype, shape, int(math.prod(shape) * DTYPE_BYTES[dtype] + 0.5)))
    return out


def _group_size(attrs: str) -> int:
    """Devices per replica group from a collective's `replica_groups` (explicit lists, iota
    `[G,S]<=[...]`, or mesh-axes form `mesh['a'=2,'b'=4] {'b'}`); 0 where there is none."""
    m = re.search(r"replica_groups=\{(\{[^}]*\})", attrs)
    if m:
        return len([x for x in m.group(1).strip("{}").split(",") if x.strip()])
    m = re.search(r"replica_groups=\[([0-9,]+)\]<=", attrs)
    if m:
        return int(m.group(1).split(",")[-1])
    m = re.search(r"replica_groups=mesh\[([^\]]*)\]\s*\{([^}]*)\}", attrs)
    if m:
        sizes = dict(re.findall(r"'([^']+)'=(\d+)", m.group(1)))
        size = 1
        for axis in re.findall(r"'([^']+)'", m.group(2)):
            size *= int(sizes.get(axis, 1))
        return size
    return 0


def _kind(opcode: str) -> str | None:
    base = opcode.removesuffix("-start")
    return base if base in KINDS and not opcode.endswith("-done") else None


def _collective(module: Module, computation: str, inst: _Instruction,
                types: dict[str, str]) -> Collective:
    """A collective instruction's record: its buffers are its operands' and results' arrays
    (an async start's tuple type holds both)."""
    operand_arrays = [a for o in inst.operands for a in arrays(types.get(o, ""))]
    result_arrays = arrays(inst.type)
    if inst.opcode.endswith("-start"):  # (operands..., results..., [context]) or the result
        done = next((i for i in module.computations[computation]
                     if i.opcode == inst.opcode.replace("-start", "-done")
                     and inst.name in i.operands), None)
        if done is not None:
            result_arrays = arrays(done.type)
    sides = [operand_arrays, result_arrays]
    side = max(sides, key=lambda arrays: sum(a[2] for a in arrays))
    dtype, shape, _ = max(side, key=lambda a: a[2]) if side else ("token", (), 0)
    return Collective(kind=_kind(inst.opcode) or inst.opcode, dtype=dtype, shape=shape,
                      bytes=sum(a[2] for a in side), group=_group_size(inst.attrs),
                      name=inst.name, buffers=tuple(side))


def trip_count(inst: _Instruction) -> int | None:
    """A `while` instruction's trip count where XLA knows it (its backend config), else None."""
    m = _TRIP_COUNT.search(inst.attrs)
    return int(m.group(1)) if m else None


def _walk(module: Module, computation: str, nested_trips: bool,
          seen: tuple[str, ...] = ()) -> Iterable[tuple[str, _Instruction, int]]:
    """(computation, instruction, times per iteration of `computation`'s caller) of every
    instruction `computation` runs, following called computations; a nested `while`'s body
    counts its trip count times when `nested_trips` (else once)."""
    if computation in seen or computation not in module.computations:
        return
    for inst in module.computations[computation]:
        yield computation, inst, 1
        if inst.opcode in _NOT_FOLLOWED:
            continue
        times = 1
        if inst.opcode == "while" and nested_trips:
            times = trip_count(inst) or 1
        for callee in inst.called:
            for comp, sub, t in _walk(module, callee, nested_trips, seen + (computation,)):
                yield comp, sub, t * (times if inst.opcode == "while" else 1)


def loops(module: Module) -> list[tuple[str, _Instruction, int]]:
    """Every `while` of the module: (computation holding it, the instruction, dot / convolution
    instructions its body runs per iteration, nested loops and calls counted once each)."""
    out = []
    for comp, insts in module.computations.items():
        for inst in insts:
            if inst.opcode != "while":
                continue
            body = _body(inst)
            dots = sum(1 for _, i, _ in _walk(module, body, nested_trips=False)
                       if i.opcode in _MATMULS or (i.opcode == "custom-call"
                                                   and "matmul" in i.attrs.lower()))
            out.append((comp, inst, dots))
    return out


def _body(inst: _Instruction) -> str:
    m = re.search(r"\bbody=%?([\w.\-]+)", inst.attrs)
    if not m:
        raise HloError(f"while {inst.name!r} names no body")
    return m.group(1)


def decode_loop(module: Module, while_name: str | None = None,
                body: str | None = None) -> _Instruction:
    """The `while` named (`while_name`, or by its `body`), else the one with the most dot /
    convolution instructions per iteration, a tie going to the innermost (module docstring)."""
    found = loops(module)
    if not found:
        raise HloError("no while loop in the HLO module")
    if while_name or body:
        for _, inst, _ in found:
            if inst.name == while_name or _body(inst) == body:
                return inst
        names = [(i.name, _body(i)) for _, i, _ in found]
        raise HloError(f"no while named {while_name or body!r}; the module's (while, body): "
                       f"{names}")
    most = max(d for _, _, d in found)
    best = [inst for _, inst, d in found if d == most]

    def inside(inst: _Instruction) -> int:  # how many of the other candidates hold it
        return sum(1 for other in best if other is not inst and any(
            i is inst for _, i, _ in _walk(module, _body(other), nested_trips=False)))

    return max(best, key=inside)


def loop_body_collectives(hlo_text: str | Module, while_name: str | None = None,
                          body: str | None = None, follow_calls: bool = True
                          ) -> list[Collective]:
    """The collectives one iteration of a loop runs on one device, in text order (the decode
    loop by default: `decode_loop`); a collective inside a nested loop appears once per trip.
    `follow_calls=False` reads the body computation's own instructions only (not the fusions,
    branches, async wrappers and loops it calls): how the issue's figures were read, which
    misses, e.g., libtpu's all-reduce-scatter fusions (module docstring)."""
    module = hlo_text if isinstance(hlo_text, Module) else parse(hlo_text)
    loop = decode_loop(module, while_name, body)
    out: list[Collective] = []
    types_of: dict[str, dict[str, str]] = {}
    walked = (_walk(module, _body(loop), nested_trips=True) if follow_calls else
              ((_body(loop), inst, 1) for inst in module.computations[_body(loop)]))
    for comp, inst, times in walked:
        if _kind(inst.opcode) is None:
            continue
        types = types_of.setdefault(comp, module.types(comp))
        out += [_collective(module, comp, inst, types)] * times
    return out


# Custom-call targets of JAX's Pallas kernels: Triton on GPU, Mosaic on TPU.
PALLAS_TARGETS = ("__gpu$xla.gpu.triton", "tpu_custom_call")


def loop_body_kernels(hlo_text: str | Module, while_name: str | None = None) -> int:
    """Pallas kernel calls one iteration of a loop runs (the decode loop by default). In the
    rollout's decode loop those are the decode attention's ragged kernels
    (`models.decode_attention`), which read only each row's live KV slots."""
    module = hlo_text if isinstance(hlo_text, Module) else parse(hlo_text)
    loop = decode_loop(module, while_name)
    count = 0
    for _, inst, times in _walk(module, _body(loop), nested_trips=True):
        target = re.search(r'custom_call_target="([^"]+)"', inst.attrs)
        if inst.opcode == "custom-call" and target and target.group(1) in PALLAS_TARGETS:
            count += times
    return count


# Opcodes whose results are no newly written array: views, tuples, in-place updates of a
# loop-carried buffer, control flow (what their computations write is counted there).
_NOT_WRITTEN = ("parameter", "get-tuple-element", "tuple", "bitcast", "constant",
                "dynamic-update-slice", "while", "call", "conditional", "async-start",
                "async-update", "async-done", "copy-start", "copy-done", "opt-barrier")
_FLOATS = ("f16", "bf16", "f32", "f64")
# Opcodes whose called computations are followed (their instructions run as kernels of their
# own); a fusion's computation is one kernel, and a custom call's, reduce's or sort's a scalar
# function, so theirs are not.
_FOLLOWED = ("while", "call", "conditional", "async-start")


def loop_body_float_arrays(hlo_text: str | Module, elements: int,
                           while_name: str | None = None) -> list[tuple[str, str, int]]:
    """Float arrays of exactly `elements` elements that one iteration of a loop writes to memory
    (the decode loop by default), as (instruction name, type, bytes), once per trip of a nested
    loop. Only the results of instructions the loop body runs as kernels count (fusions,
    copies, converts, broadcasts, custom calls...), not what happens inside a fusion, and not
    views or in-place updates (`_NOT_WRITTEN`).

    What it is for: with an 8-bit KV cache the loop should hold no float array as large as one
    layer's cache on the device; one that it does hold is a dequantised copy of the cache (an
    attention that takes float values) or a broadcast of its scales to the cache's shape (JAX's
    TPU paged kernel wrapper), written and read again every step (`plan.interconnect`)."""
    module = hlo_text if isinstance(hlo_text, Module) else parse(hlo_text)
    loop = decode_loop(module, while_name)
    out: list[tuple[str, str, int]] = []

    def visit(computation: str, times: int, seen: tuple[str, ...]) -> None:
        if computation in seen or computation not in module.computations:
            return
        for inst in module.computations[computation]:
            if inst.opcode not in _NOT_WRITTEN:
                for dtype, shape, nbytes in arrays(inst.type):
                    if dtype in _FLOATS and math.prod(shape) == elements:
                        out.extend([(inst.name, f"{dtype}[{','.join(map(str, shape))}]",
                                     nbytes)] * times)
            if inst.opcode in _FOLLOWED:
                trips = (trip_count(inst) or 1) if inst.opcode == "while" else 1
                for callee in inst.called:
                    if inst.opcode != "while" or callee == _body(inst):
                        visit(callee, times * trips, seen + (computation,))

    visit(_body(loop), 1, ())
    return out


@dataclasses.dataclass(frozen=True)
class Summary:
    """Collectives counted: how many, their bytes (`Collective.bytes`) and link bytes, per kind
    (count, bytes), and the bytes of their first buffers only (module docstring)."""

    count: int
    bytes: int
    link_bytes: float
    by_kind: dict[str, tuple[int, int]]
    first_buffer_bytes: int = 0

    def __iter__(self):  # count, bytes, by_kind = summarize(...)
        return iter((self.count, self.bytes, self.by_kind))


def summarize(found: Sequence[Collective]) -> Summary:
    """(count, bytes, by kind) of a list of collectives; also their link bytes."""
    kinds: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for c in found:
        kinds[c.kind][0] += 1
        kinds[c.kind][1] += c.bytes
    return Summary(count=len(found), bytes=sum(c.bytes for c in found),
                   link_bytes=sum(c.link_bytes for c in found),
                   by_kind={k: (v[0], v[1]) for k, v in sorted(kinds.items())},
                   first_buffer_bytes=sum(c.first_buffer_bytes for c in found))


def biggest(found: Sequence[Collective], top: int = 5) -> list[tuple[str, int, int]]:
    """The `top` operands by bytes: (kind dtype[shape], how many, their bytes in all)."""
    groups: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for c in found:
        key = f"{c.kind} {c.dtype}[{','.join(map(str, c.shape))}]"
        groups[key][0] += 1
        groups[key][1] += c.bytes
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]
    return [(k, n, b) for k, (n, b) in ranked]


def describe(found: Sequence[Collective], top: int = 5) -> list[str]:
    """Lines for a person: the totals, per kind, and the biggest operands."""
    s = summarize(found)
    lines = [f"{s.count} collectives, {s.bytes / 2**20:.1f} MiB per iteration per device "
             f"({s.link_bytes / 2**20:.1f} MiB sent per device by ring algorithms; first "
             f"buffers of combined collectives only: {s.first_buffer_bytes / 2**20:.1f} MiB)"]
    lines += [f"  {kind}: {n}, {b / 2**20:.2f} MiB" for kind, (n, b) in s.by_kind.items()]
    if found:
        lines.append("  biggest:")
        lines += [f"    {n} x {key}: {b / 2**20:.2f} MiB" for key, n, b in biggest(found, top)]
    return lines


def to_json(found: Sequence[Collective], top: int = 5) -> dict:
    """JSON-able figures of `found`: count, bytes, link_bytes, by_kind, biggest."""
    s = summarize(found)
    out = {"count": s.count, "bytes": s.bytes, "link_bytes": s.link_bytes,
           "first_buffer_bytes": s.first_buffer_bytes,
           "by_kind": {k: {"count": n, "bytes": b} for k, (n, b) in s.by_kind.items()},
           "biggest": [{"operand": k, "count": n, "bytes": b} for k, n, b in biggest(found, top)]}
    return out
