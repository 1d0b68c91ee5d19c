"""What a compiled GPU program launches per generated token, read from XLA's dump of it: no device.

    found = kernels.read_dump("/tmp/dump")                 # or kernels.compile_and_read(lowered)
    table = kernels.per_token(found, steps_per_call=16)    # kernels, bytes, host reads a token
    step = kernels.predict_step(table, kernels.H100)       # bytes / bandwidth + launches x cost

XLA:GPU writes, per compiled module, the thunk sequence its runtime executes
(`*.thunk_sequence_after_thunk_passes.txt`, or `*.thunk_sequence.txt` where the thunk passes
changed nothing: every kernel launch, copy, collective and library call
in order, nested in command buffers, while loops and async wrappers), which HLO instruction each
thunk runs (`*.thunk_metadata.txt`: thunk id -> profile annotation, the instruction's name), and the
optimized HLO (`*.sm_*_gpu_after_optimizations.txt`: what each fusion reads and writes). This
module reads the three: a pure reader of text, nothing is compiled or run here except by
`compile_and_read`, which compiles a lowered program with XLA's dump turned on for that program
only (`compiler_options`, so no global flag) into a scratch directory.

Scopes. Each launch belongs to a scope by where it sits:
- 'token': inside the decode loop's body (or its condition), once per decode step. The decode
  loop is the `while` whose body runs the most dots (`plan.collectives.decode_loop`); when it has
  a known trip count (a chunk of K steps, `sampling`'s GPU programs) it is still one step per
  iteration.
- 'chunk': inside a loop around the decode loop, once per chunk of decode steps.
- 'call': outside every loop, once per call of the program (the refilling sampler calls its
  decode program every `steps_per_call` tokens; the static sampler once per generation).
A nested loop's launches count its known trip count times (once when unknown).

Launches. Every thunk that starts work on the device counts as one launch: kernels (XLA's
fusions, Triton GEMMs, Pallas kernels), library calls (cuBLAS, cuDNN), copies, memsets,
collectives, partition-id reads. Containers (command buffers, sequential thunks, while and
conditional thunks, async wrappers) do not; a command buffer is one CUDA graph launch of the
thunks inside it, which still run as that many kernels on the device.

Host transfers. A `while` thunk that is not inside a command buffer and has no known trip count
copies its predicate to the host every iteration (XLA's WhileThunk), and the host launches the
next iteration after reading it: one device-to-host transfer and a synchronisation per
iteration. A `while` with a known trip count runs its iterations without reading the predicate,
and one captured in a command buffer (`xla_gpu_enable_command_buffer` with WHILE) evaluates it on
the device (a CUDA conditional node). Host callbacks, sends, receives, infeeds and outfeeds count
where they sit.

Bytes. Per launch, from the optimized HLO: a fusion reads each operand whole, except an operand
its fused computation only slices (a slice, dynamic slice or gather: their results' bytes) or
updates in place (the first operand of a scatter or dynamic-update-slice root whose result is the
fusion's: nothing; the update's bytes count as written); it writes its results. A custom call (a
Pallas kernel, a library GEMM) reads every operand whole: an attention kernel's key and value
pools are read only where rows are live, which the caller's `live_fraction` scales
(`per_token`). Collectives count their buffers.

Weights made wider or transposed. A rank-2 array of the program's parameters (a weight matrix)
that a launch other than a matrix product turns into an array of the same dimensions (or
permuted dimensions) in a wider type is a *widened copy* in HBM (an int8 or fp8 weight
dequantized outside the product); in the same type with permuted dimensions (or another layout,
or by a transpose: a square weight's copy keeps its shape) a *transposed copy*. Found by following
the launch's operands back through bitcasts, tuples and loop parameters to the program's
parameters.

The step model (`predict_step`): every launch of a scope costs its bytes over the chip's bandwidth
(attention kernels their live keys and values at the kernel's measured rate) plus a fixed cost
per launch, every host read of a predicate a fixed round trip, and a refilling sampler's call its
host loop; the 'chunk' and 'call' scopes are spread over the tokens they cover. The constants are
calibrated on the leased GPUs' measurements (`CALIBRATION`, docs/performance.md): predictions,
not measurements.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import math
import os
import re
import tempfile
from typing import Any

from qurl_jax.plan import collectives as hlo

# ------------------------------------------------------------------------------ the dump's text
_THUNK = re.compile(r"^(\s*)(\d+):\s+(k\w+)\s*\[[^\]]*\]\s*(.*?)\s*$")
_SECTION = re.compile(r"^\s*(condition|body|branch\s*\d*|branch_\d+|default):\s*$")
_GRID = re.compile(r"grid:\s*\[([^\]]*)\]")
_META = re.compile(r'profile_annotation:\s*"([^"]*)"\s*thunk_id:\s*(\d+)\s*\}\s*'
                   r'thunk_kind:\s*"(\w+)"', re.S)
# Thunks that only hold or order others: no work on the device of their own.
CONTAINERS = ("kCommandBuffer", "kSequential", "kWhile", "kConditional", "kAsyncStart",
              "kAsyncDone", "kWaitForStreams", "kNcclGroup", "kDynamicSlice")
HOST_THUNKS = ("kHostSend", "kHostSendDone", "kHostRecv", "kHostRecvDone", "kInfeed",
               "kOutfeed", "kSend", "kRecv")
_COLLECTIVE_THUNKS = ("kAllGather", "kAllReduce", "kReduceScatter", "kAllToAll",
                      "kCollectivePermute", "kCollectiveBroadcast", "kRaggedAllToAll",
                      "kAllGatherStart", "kAllReduceStart", "kReduceScatterStart",
                      "kCollectivePermuteStart")
_HOST_CALLBACK = ("callback", "host_")
# A Pallas kernel's category by its name, first match (`Program.category`).
_PALLAS_NAMES = (("product", r"w8a8|matmul|gemm"), ("reduce", r"combine"),
                 ("attention", r"attention|attn|mha|decode"))


class DumpError(ValueError):
    """A dump directory or text without what this reader needs; the message names it."""


@dataclasses.dataclass(frozen=True)
class Thunk:
    """One entry of a thunk sequence: its id, kind and kernel name, the HLO instruction it runs
    (`name`, from the metadata; '' for containers), the path of containers around it (each
    '<kind>:<id>[/section]', outermost first), whether a command buffer holds it."""

    id: int
    kind: str
    kernel: str
    name: str
    path: tuple[str, ...]
    grid: tuple[int, ...] = ()

    @property
    def launches(self) -> bool:
        return self.kind not in CONTAINERS

    @property
    def in_command_buffer(self) -> bool:
        return any(p.startswith("kCommandBuffer:") for p in self.path)


def parse_thunks(sequence: str, metadata: str = "") -> list[Thunk]:
    """The thunks of `*.thunk_sequence_after_thunk_passes.txt`, with the HLO instruction of each
    from `*.thunk_metadata.txt` (its profile annotation by thunk id)."""
    names = {int(i): n for n, i, _ in _META.findall(metadata)}
    out: list[Thunk] = []
    stack: list[tuple[int, str]] = []  # (indent, path entry)
    for line in sequence.splitlines():
        section = _SECTION.match(line)
        if section:
            # A section names the part of the innermost loop or conditional being listed; its
            # own indentation is not reliable (XLA prints 'condition:' at column 0).
            for i in range(len(stack) - 1, -1, -1):
                kind = stack[i][1].split(":")[0]
                if kind in ("kWhile", "kConditional"):
                    del stack[i + 1:]
                    indent, entry = stack[i]
                    stack[i] = (indent, entry.split("/")[0] + "/" + section.group(1).strip())
                    break
            continue
        m = _THUNK.match(line)
        if not m:
            continue
        indent, tid, kind, rest = len(m.group(1)), int(m.group(2)), m.group(3), m.group(4)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        kernel = rest.split(" grid:")[0].strip() or kind
        grid = _GRID.search(rest)
        dims = tuple(int(x) for x in grid.group(1).split(",")) if grid else ()
        thunk = Thunk(tid, kind, kernel, names.get(tid, ""), tuple(e for _, e in stack), dims)
        out.append(thunk)
        stack.append((indent, f"{kind}:{tid}"))
    if not out:
        raise DumpError("no thunk in the thunk sequence text")
    return out


# ------------------------------------------------------------------------------ the HLO's bytes
_HEADER = re.compile(r"^(?:ENTRY\s+)?%?([^\s(]+)\s*\((.*)\)\s*->.*\{\s*$")
_PARAM = re.compile(r"([\w.\-]+):\s*")
_SLICING = ("slice", "dynamic-slice", "gather")
_IN_PLACE = ("scatter", "dynamic-update-slice")
_VIEWS = ("bitcast", "get-tuple-element", "copy", "tuple", "reshape", "opt-barrier")
_FLOAT_WIDTH = {"f16": 2, "bf16": 2, "f32": 4, "f64": 8}
EIGHT_BIT = ("s8", "u8", "f8e4m3fn", "f8e4m3", "f8e5m2", "f8e4m3fnuz", "f8e5m2fnuz",
             "f8e4m3b11fnuz", "f8e3m4")


def _header_params(hlo_text: str) -> dict[str, list[str]]:
    """Computation name -> its parameters' names in order (the header's list)."""
    out = {}
    for line in hlo_text.splitlines():
        m = _HEADER.match(line)
        if not m or line.startswith("HloModule"):
            continue
        depth, names, start = 0, [], True
        for ch_i, ch in enumerate(m.group(2)):
            if start:
                p = _PARAM.match(m.group(2), ch_i)
                if p:
                    names.append(p.group(1).lstrip("%"))
                start = False
            depth += {"(": 1, "[": 1, "{": 1, ")": -1, "]": -1, "}": -1}.get(ch, 0)
            if ch == "," and depth == 0:
                start = True
        out[m.group(1).lstrip("%")] = names
    return out


def _nbytes(type_text: str) -> int:
    return sum(a[2] for a in hlo.arrays(type_text))


def _layout(type_text: str) -> str:
    m = re.search(r"\]\{([0-9,]*)", type_text)
    return m.group(1) if m else ""


@dataclasses.dataclass
class Program:
    """The optimized HLO module, indexed: instruction name -> (computation, instruction), each
    computation's parameter names in order, and who calls each computation."""

    module: hlo.Module
    where: dict[str, tuple[str, Any]]
    params: dict[str, list[str]]
    callers: dict[str, tuple[str, Any]]

    @classmethod
    def parse(cls, hlo_text: str) -> Program:
        module = hlo.parse(hlo_text)
        where, callers = {}, {}
        for comp, insts in module.computations.items():
            for inst in insts:
                where[inst.name] = (comp, inst)
                for callee in inst.called:
                    callers.setdefault(callee, (comp, inst))
        return cls(module, where, _header_params(hlo_text), callers)

    def entry_parameters(self) -> dict[str, str]:
        """The program's parameters: name -> type."""
        return {i.name: i.type for i in self.module.computations[self.module.entry]
                if i.opcode == "parameter"}

    def source(self, name: str, depth: int = 0) -> str | None:
        """The entry parameter `name` is a view of (through bitcasts, copies, tuples, loop and
        fusion parameters), or None."""
        if depth > 64 or name not in self.where:
            return None
        comp, inst = self.where[name]
        if inst.opcode == "parameter":
            if comp == self.module.entry:
                return name
            return self._through_parameter(comp, name, None, depth)
        if inst.opcode == "get-tuple-element":
            index = int(re.search(r"index=(\d+)", inst.attrs).group(1))
            operand = self.where.get(inst.operands[0])
            if operand and operand[1].opcode == "parameter" and operand[0] != self.module.entry:
                return self._through_parameter(operand[0], operand[1].name, index, depth)
            if operand and operand[1].opcode == "tuple":
                return self.source(operand[1].operands[index], depth + 1)
            return self.source(inst.operands[0], depth + 1) if operand else None
        if inst.opcode in ("bitcast", "copy", "reshape", "opt-barrier") and inst.operands:
            return self.source(inst.operands[0], depth + 1)
        return None

    def _through_parameter(self, comp: str, name: str, index: int | None, depth: int
                           ) -> str | None:
        caller = self.callers.get(comp)
        if caller is None:
            return None
        _, call = caller
        if call.opcode == "while":  # its body's and condition's one parameter is the loop state
            init = self.where.get(call.operands[0])
            if init and init[1].opcode == "tuple" and index is not None:
                return self.source(init[1].operands[index], depth + 1)
            return self.source(call.operands[0], depth + 1) if index is None else None
        order = self.params.get(comp, [])
        if name in order and order.index(name) < len(call.operands):
            return self.source(call.operands[order.index(name)], depth + 1)
        return None

    def read_written(self, name: str) -> tuple[int, int, list[int]]:
        """(bytes read, bytes written, per-operand bytes read) of one launched instruction (the
        module docstring's rule)."""
        comp, inst = self.where[name]
        types = self.module.types(comp)
        operand_bytes = [_nbytes(types.get(o, "")) for o in inst.operands]
        written = _nbytes(inst.type)
        if inst.opcode == "fusion" and inst.called:
            fused = inst.called[0]
            body = self.module.computations.get(fused, [])
            order = self.params.get(fused, [])
            users: dict[str, list[Any]] = collections.defaultdict(list)
            for i in body:
                for o in i.operands:
                    users[o].append(i)
            root = body[-1] if body else None
            roots = ([self.where[o][1] for o in root.operands if o in self.where]
                     if root is not None and root.opcode == "tuple" else [root])
            in_place = {r.operands[0]: r for r in roots
                        if r is not None and r.opcode in _IN_PLACE and r.operands}
            for k, param in enumerate(order[:len(operand_bytes)]):
                if param in in_place:
                    r = in_place[param]
                    update = r.operands[-1] if r.opcode == "scatter" else r.operands[1]
                    update_bytes = _nbytes(self.module.types(fused).get(update, ""))
                    operand_bytes[k] = 0
                    written += update_bytes - _nbytes(r.type)
                    continue
                uses = users.get(param, [])
                if uses and all(u.opcode in _SLICING and u.operands[0] == param for u in uses):
                    operand_bytes[k] = min(operand_bytes[k], sum(_nbytes(u.type) for u in uses))
        return sum(operand_bytes), max(written, 0), operand_bytes

    def category(self, name: str, kind: str, kernel: str) -> str:
        """What a launch does, for a person: 'product', 'attention', 'pallas', 'write' (a
        scatter or in-place update: the KV cache, the outputs), 'transpose', 'copy',
        'quantize' (an 8-bit result), 'norm' (XLA's Triton normalisation fusions), 'reduce',
        'elementwise', 'collective', 'host', 'other'. A Pallas kernel is read by its name: a
        product (`quant.w8a8_product`, a matmul), a split-combine ('reduce'), an attention
        kernel, or by its results (8-bit: 'quantize'), else 'pallas'."""
        if kind in _COLLECTIVE_THUNKS:
            return "collective"
        if kind in HOST_THUNKS:
            return "host"
        if kind == "kCopy":
            return "copy"
        if kind in ("kGemm", "kCublasLtMatmul") or "gemm" in kernel or "cublas" in kernel:
            return "product"
        if name not in self.where:
            return "other"
        _, inst = self.where[name]
        target = re.search(r'custom_call_target="([^"]+)"', inst.attrs)
        if inst.opcode == "custom-call" and target:
            t = target.group(1)
            if any(c in t.lower() for c in _HOST_CALLBACK):
                return "host"
            if re.search(r"gemm|matmul|cublas", t, re.I):
                return "product"
            if t in hlo.PALLAS_TARGETS:
                return next((c for c, pattern in _PALLAS_NAMES if re.search(pattern, kernel, re.I)),
                            "quantize" if any(a[0] in EIGHT_BIT for a in hlo.arrays(inst.type))
                            else "pallas")
            return "other"
        if inst.opcode != "fusion":
            return "copy" if inst.opcode == "copy" else "other"
        body = self.module.computations.get(inst.called[0], []) if inst.called else []
        ops = {i.opcode for i in body}
        if "dot" in ops or '"__triton_gemm"' in inst.attrs or "gemm_fusion" in name:
            return "product"
        root = body[-1].opcode if body else ""
        if root in _IN_PLACE or (root == "tuple" and ops & set(_IN_PLACE)):
            return "write"
        if root in ("transpose", "copy") or "transpose" in name:
            return "transpose"
        if any(a[0] in EIGHT_BIT for a in hlo.arrays(inst.type)):
            return "quantize"
        if "kind=kCustom" in inst.attrs:
            return "norm"
        if "reduce" in ops:
            return "reduce"
        return "elementwise"


# ------------------------------------------------------------------------------ the reading
@dataclasses.dataclass(frozen=True)
class Launch:
    """One launch of a scope: the HLO instruction and kernel, its thunk kind and category, the
    bytes it reads and writes (`kv_bytes`: what of its reads are attention key/value pools,
    which `per_token` scales by the live fraction), its scope ('token', 'chunk', 'call'), how
    many times it runs per iteration of its scope, whether a command buffer holds it and
    whether it belongs to the decode loop's condition."""

    name: str
    kernel: str
    kind: str
    category: str
    bytes_read: int
    bytes_written: int
    scope: str
    times: int = 1
    in_command_buffer: bool = False
    condition: bool = False
    kv_bytes: int = 0


@dataclasses.dataclass(frozen=True)
class WeightCopy:
    """A launch that turns weight `weight` (type `weight_type`) into `result_type` in HBM:
    'widened' (an 8-bit weight to a wider float) or 'transposed' (the same type, dimensions or
    layout permuted), in scope `scope`."""

    launch: str
    weight: str
    weight_type: str
    result_type: str
    how: str
    scope: str


@dataclasses.dataclass(frozen=True)
class Reading:
    """A compiled program read: its launches, the predicate reads of its loops by scope
    (`host_reads`), host transfers of other kinds by scope (`host_transfers`), weight copies,
    the decode loop's trip count (None: unknown) and whether it sits in a command buffer, the
    matrix products of the decode loop (`products_per_token`, XLA's dot fusions and library
    GEMMs) and the number of layers the caller names (for per-layer figures)."""

    launches: tuple[Launch, ...]
    host_reads: dict[str, int]
    host_transfers: dict[str, int]
    weight_copies: tuple[WeightCopy, ...]
    decode_trip_count: int | None
    decode_loop_in_command_buffer: bool
    module: str = ""


def _while_trip_counts(program: Program) -> dict[str, int | None]:
    out = {}
    for name, (_, inst) in program.where.items():
        if inst.opcode == "while":
            out[name] = hlo.trip_count(inst)
    return out


def read(sequence: str, metadata: str, hlo_text: str, module: str = "") -> Reading:
    """Reads a compiled program from its dump's three texts (module docstring)."""
    program = Program.parse(hlo_text)
    thunks = parse_thunks(sequence, metadata)
    trips = _while_trip_counts(program)
    try:
        decode = hlo.decode_loop(program.module).name
    except hlo.HloError:
        decode = None
    by_id = {t.id: t for t in thunks}
    decode_thunk = next((t for t in thunks if t.kind == "kWhile" and t.name == decode), None)
    if decode is not None and decode_thunk is None:
        raise DumpError(f"the decode loop {decode!r} has no while thunk in the thunk sequence")

    def scope_of(t: Thunk) -> tuple[str, int, bool]:
        """(scope, times per iteration of the scope, in the decode loop's condition)."""
        times, inside, condition = 1, False, False
        for entry in t.path:
            kind, _, rest = entry.partition(":")
            tid, _, section = rest.partition("/")
            if kind != "kWhile":
                continue
            loop = by_id[int(tid)]
            if inside:  # a loop nested in the decode step
                if section == "body":
                    times *= trips.get(loop.name) or 1
                continue
            if decode_thunk is not None and loop.id == decode_thunk.id:
                inside, condition = True, section == "condition"
        if inside:
            return "token", times, condition
        if any(e.startswith("kWhile:") for e in t.path):
            return "chunk", times, False
        return "call", times, False

    launches, weight_copies = [], []
    host_reads: collections.Counter[str] = collections.Counter()
    host_transfers: collections.Counter[str] = collections.Counter()
    params = program.entry_parameters()
    weights = {n: ty for n, ty in params.items()
               if len(hlo.arrays(ty)) == 1 and len(hlo.arrays(ty)[0][1]) == 2
               and min(hlo.arrays(ty)[0][1]) >= 16}
    for t in thunks:
        scope, times, condition = scope_of(t)
        if t.kind == "kWhile":
            known = trips.get(t.name) is not None
            if not known and not t.in_command_buffer:
                # The loop's own iterations: its predicate is read where its body runs.
                body_scope = "token" if decode_thunk is not None and t.id == decode_thunk.id \
                    else ("chunk" if scope == "call" else scope)
                host_reads[body_scope] += times
            continue
        if not t.launches:
            continue
        category = program.category(t.name, t.kind, t.kernel)
        if category == "host":
            host_transfers[scope] += times
        read_b = written = kv = 0
        if t.name in program.where:
            read_b, written, per_operand = program.read_written(t.name)
            if category == "attention":
                kv = sum(b for b in per_operand if b >= 1 << 20)
            _, inst = program.where[t.name]
            if category not in ("product", "attention", "pallas"):
                weight_copies += _weight_copies(program, inst, weights, scope,
                                                category == "transpose")
        launches.append(Launch(t.name, t.kernel, t.kind, category, read_b, written, scope,
                               times, t.in_command_buffer, condition, kv))
    return Reading(tuple(launches), dict(host_reads), dict(host_transfers), tuple(weight_copies),
                   trips.get(decode) if decode else None,
                   bool(decode_thunk and decode_thunk.in_command_buffer), module)


def _weight_copies(program: Program, inst: Any, weights: dict[str, str], scope: str,
                   transposes: bool) -> list[WeightCopy]:
    """The weights `inst` writes a widened or transposed copy of (module docstring);
    `transposes`: `inst` is a transpose (a square weight's copy keeps its shape)."""
    out = []
    results = hlo.arrays(inst.type)
    for operand in inst.operands:
        src = program.source(operand)
        if src not in weights:
            continue
        (w_dtype, w_shape, _), = hlo.arrays(weights[src])
        for dtype, shape, _ in results:
            if sorted(shape) != sorted(w_shape) or math.prod(shape) != math.prod(w_shape):
                continue
            if w_dtype in EIGHT_BIT and dtype in _FLOAT_WIDTH:
                out.append(WeightCopy(inst.name, src, weights[src], inst.type, "widened", scope))
            elif dtype == w_dtype and (transposes or tuple(shape) != tuple(w_shape)
                                       or _layout(inst.type) != _layout(weights[src])):
                out.append(WeightCopy(inst.name, src, weights[src], inst.type, "transposed",
                                      scope))
    return out


def _dump_file(directory: str, pattern: str, module_re: str) -> str:
    found = sorted(f for f in glob.glob(os.path.join(directory, pattern))
                   if re.search(module_re, os.path.basename(f)))
    if not found:
        raise DumpError(f"{directory}: no {pattern} of a module matching {module_re!r} (was the "
                        "program compiled with --xla_dump_to and --xla_dump_hlo_as_text?)")
    return found[-1]


def read_dump(directory: str, module_re: str = r"decode") -> Reading:
    """Reads the last module matching `module_re` in an XLA dump directory: its thunk sequence
    after XLA's thunk passes (which form the command buffers), or as emitted when the passes
    changed nothing (XLA then writes no second file)."""
    seq = _dump_file(directory, "*.thunk_sequence.txt", module_re)
    prefix = seq.removesuffix(".thunk_sequence.txt")
    if os.path.exists(prefix + ".thunk_sequence_after_thunk_passes.txt"):
        seq = prefix + ".thunk_sequence_after_thunk_passes.txt"
    meta = prefix + ".thunk_metadata.txt"
    hlo_files = sorted(glob.glob(prefix + ".sm_*_gpu_after_optimizations.txt"))
    if not hlo_files:
        raise DumpError(f"{directory}: no optimized HLO beside {os.path.basename(seq)}")
    with open(seq) as f, open(meta) as g, open(hlo_files[0]) as h:
        return read(f.read(), g.read(), h.read(), os.path.basename(prefix))


def compile_and_read(lowered: Any, compiler_options: dict[str, Any] | None = None,
                     keep: str | None = None) -> Reading:
    """Compiles `lowered` (a `jax.stages.Lowered` for a GPU target) with XLA's dump on for this
    program only, into `keep` or a scratch directory, and reads it."""
    with tempfile.TemporaryDirectory(prefix="qurl_jax_dump_") as scratch:
        directory = keep or scratch
        options = {**(compiler_options or {}), "xla_dump_to": directory,
                   "xla_dump_hlo_as_text": True}
        lowered.compile(compiler_options=options)
        return read_dump(directory, module_re=".")


# ------------------------------------------------------------------------------ per token
@dataclasses.dataclass(frozen=True)
class PerToken:
    """A reading spread over generated tokens: launches and bytes per token (each scope's
    share: 'token' whole, 'chunk' over the decode loop's trip count, 'call' over
    `steps_per_call`), by scope and by category, host reads and transfers per token, and the
    weight copies per call."""

    launches: float
    bytes: float
    attention_bytes: float
    by_scope: dict[str, tuple[int, int]]  # scope -> (launches per iteration, bytes)
    by_category: dict[str, tuple[int, int]]  # the 'token' scope's launches and bytes
    host_reads: float
    host_transfers: float
    widened: int
    transposed: int
    steps_per_call: int
    tokens_per_chunk: int

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> PerToken:
        """The table back from `to_json`'s figures."""
        return cls(
            launches=d["launches_per_token"], bytes=d["bytes_per_token"],
            attention_bytes=d["attention_bytes_per_token"],
            by_scope={k: (v["launches"], v["bytes"]) for k, v in d["by_scope"].items()},
            by_category={k: (v["launches"], v["bytes"]) for k, v in d["by_category"].items()},
            host_reads=d["host_reads_per_token"], host_transfers=d["host_transfers_per_token"],
            widened=d["weights_widened"], transposed=d["weights_transposed"],
            steps_per_call=d["steps_per_call"], tokens_per_chunk=d["tokens_per_chunk"])

    def per_layer(self, layers: int) -> float:
        """Launches of the decode step per layer (its 'token' scope over `layers`)."""
        return self.by_scope.get("token", (0, 0))[0] / max(layers, 1)


def per_token(reading: Reading, steps_per_call: int, live_fraction: float = 1.0) -> PerToken:
    """The reading's figures per generated token, for a program called every `steps_per_call`
    tokens, its attention kernels reading `live_fraction` of their key/value pools."""
    chunk = reading.decode_trip_count or 1
    share = {"token": 1.0, "chunk": 1.0 / chunk, "call": 1.0 / max(steps_per_call, 1)}
    scope: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    category: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    launches = total = attention = 0.0
    for x in reading.launches:
        nbytes = x.bytes_read + x.bytes_written - x.kv_bytes * (1 - live_fraction)
        scope[x.scope][0] += x.times
        scope[x.scope][1] += int(nbytes * x.times)
        if x.scope == "token":
            category[x.category][0] += x.times
            category[x.category][1] += int(nbytes * x.times)
        launches += x.times * share[x.scope]
        total += nbytes * x.times * share[x.scope]
        if x.category == "attention":
            attention += nbytes * x.times * share[x.scope]
    reads = sum(n * share[s] for s, n in reading.host_reads.items())
    transfers = sum(n * share[s] for s, n in reading.host_transfers.items())
    copies = reading.weight_copies
    return PerToken(
        launches=launches, bytes=total, attention_bytes=attention,
        by_scope={k: (v[0], v[1]) for k, v in scope.items()},
        by_category={k: (v[0], v[1]) for k, v in sorted(category.items(),
                                                       key=lambda kv: -kv[1][0])},
        host_reads=reads, host_transfers=transfers,
        widened=sum(1 for c in copies if c.how == "widened"),
        transposed=sum(1 for c in copies if c.how == "transposed"),
        steps_per_call=steps_per_call, tokens_per_chunk=chunk)


# ------------------------------------------------------------------------------ the step model
@dataclasses.dataclass(frozen=True)
class Chip:
    """A GPU's figures for the step model: HBM bandwidth (bytes/s, the vendor's), the cost of
    one launch (`launch_s`), of one host read of a loop predicate (`host_read_s`) and of one
    call of a decode program from the refilling sampler's host loop (`call_s`), and the rate at
    which each attention kernel reads live keys and values (`attention_rate`, bytes/s: 'dense'
    JAX's ragged kernel, 'paged' its paged kernel over bf16 pages, 'paged_8bit' over 8-bit
    pages). `CALIBRATION` says where each comes from."""

    name: str
    bandwidth: float
    launch_s: float
    host_read_s: float
    call_s: float
    attention_rate: dict[str, float]


# Measured on the leased GPUs (docs/performance.md, docs/runs/), H200, one layer's attention alone
# at the 1.5B shape (64 rows, 1024 live of 1536 slots, 64 MiB of live bf16 K/V, 33 MiB 8-bit):
# JAX's ragged kernel 32.6 us, the paged kernel 66.9 us (bf16) and 66.1 us (int8): 2.06, 1.00
# and 0.52 TB/s of live K/V. Neither reaches the HBM's rate, so the model charges them at these
# rates on every chip (the H100's paged run below agrees to 1%; charged at the same fraction of
# the H100's bandwidth instead, it was 26% over).
_ATTENTION_RATE = {"dense": 64 * 2**20 / 32.6e-6, "paged": 64 * 2**20 / 66.9e-6,
                   "paged_8bit": 33 * 2**20 / 66.1e-6}
# Fitted on two leased runs (H200, 1.5B shape, int8 actor, 64 rows, 512 + 1024 tokens), read back
# with `bench.explain` from the programs those runs ran (`CALIBRATION`): the static sampler's
# dense cache, 2.52 ms a step, gives the cost of a launch with the host's predicate read taken as
# 20 us; the refilling sampler's paged pool, 4.20 ms, gives the host loop's cost per call.
LAUNCH_S, HOST_READ_S, CALL_S = 1.33e-6, 20e-6, 6.1e-3
CHIPS: dict[str, Chip] = {  # bandwidths: NVIDIA's datasheets (H100 SXM HBM3, H200 HBM3e)
    "h100": Chip("H100 SXM", 3.35e12, LAUNCH_S, HOST_READ_S, CALL_S, _ATTENTION_RATE),
    "h200": Chip("H200", 4.8e12, LAUNCH_S, HOST_READ_S, CALL_S, _ATTENTION_RATE),
}
# The leased measurements the model is calibrated and checked on, with the readings of their
# programs (docs/runs/explain_readings_2026-11-29.json): (case, chip, attention, measured ms).
CALIBRATION = (
    ("int8_dense_64", "h200", "dense", 2.52),  # fits LAUNCH_S
    ("int8_paged_64", "h200", "paged", 4.20),  # fits CALL_S
    ("int8_paged_64", "h100", "paged", 4.35),  # checks
    ("int8_paged_kvint8_64", "h100", "paged_8bit", 4.82),  # checks
)


def predict_step(table: PerToken, chip: Chip, attention: str = "dense",
                 refill: bool = False) -> dict[str, float]:
    """The predicted decode step (seconds) of a `PerToken`, by part: 'bytes' (all but the
    attention kernels at the chip's bandwidth), 'attention' (the live keys and values at the
    measured rate of the `attention` kernel: 'dense', 'paged' or 'paged_8bit'), 'launches',
    'host' (predicate reads, and with `refill` the refilling sampler's host loop per call
    spread over the call's tokens) and their sum 'step'. A prediction, not a measurement."""
    parts = {
        "bytes": (table.bytes - table.attention_bytes) / chip.bandwidth,
        "attention": table.attention_bytes / chip.attention_rate[attention],
        "launches": table.launches * chip.launch_s,
        "host": table.host_reads * chip.host_read_s
        + (chip.call_s / max(table.steps_per_call, 1) if refill else 0.0),
    }
    parts["step"] = sum(parts.values())
    return parts


def describe(reading: Reading, table: PerToken, layers: int = 0) -> list[str]:
    """Lines for a person: launches and bytes per token by scope and category, per layer, host
    transfers, weight copies."""
    lines = []
    names = {"token": "each decode step", "chunk": f"each chunk ({table.tokens_per_chunk} "
             "steps)", "call": f"each call (every {table.steps_per_call} tokens)"}
    for scope in ("token", "chunk", "call"):
        if scope in table.by_scope:
            n, b = table.by_scope[scope]
            lines.append(f"  {names[scope]:34s} {n:5d} launches  {b / 2**20:10.1f} MiB")
    lines.append(f"  per generated token: {table.launches:.1f} launches, "
                 f"{table.bytes / 2**30:.3f} GiB read + written, {table.host_reads:.2f} host "
                 f"reads of a loop predicate, {table.host_transfers:.2f} other host transfers")
    if layers:
        lines.append(f"  decode step per layer: {table.per_layer(layers):.1f} launches "
                     f"({layers} layers)")
    lines.append("  the decode step by category (launches, MiB):")
    for cat, (n, b) in table.by_category.items():
        lines.append(f"    {cat:12s} {n:5d}  {b / 2**20:10.1f}"
                     + (f"   {n / layers:.1f} per layer" if layers else ""))
    loop = ("captured in a command buffer" if reading.decode_loop_in_command_buffer else
            "launched from the host")
    trip = reading.decode_trip_count
    lines.append(f"  decode loop: {loop}, "
                 + (f"{trip} steps per iteration of its caller (known trip count)" if trip
                    else "trip count unknown (its predicate decides)"))
    for how in ("widened", "transposed"):
        copies = [c for c in reading.weight_copies if c.how == how]
        if copies:
            by_scope = collections.Counter(c.scope for c in copies)
            lines.append(f"  weights {how} in HBM: {len(copies)} ("
                         + ", ".join(f"{n} per {s}" for s, n in by_scope.items())
                         + f"), e.g. {copies[0].weight_type} -> {copies[0].result_type} by "
                           f"{copies[0].launch}")
        else:
            lines.append(f"  weights {how} in HBM: none")
    return lines


def to_json(reading: Reading, table: PerToken, layers: int = 0) -> dict[str, Any]:
    """JSON-able figures of a reading and its per-token table."""
    return {
        "module": reading.module,
        "launches_per_token": table.launches, "bytes_per_token": table.bytes,
        "attention_bytes_per_token": table.attention_bytes,
        "launches_per_layer": table.per_layer(layers) if layers else None, "layers": layers,
        "by_scope": {k: {"launches": n, "bytes": b} for k, (n, b) in table.by_scope.items()},
        "by_category": {k: {"launches": n, "bytes": b}
                        for k, (n, b) in table.by_category.items()},
        "host_reads_per_token": table.host_reads,
        "host_transfers_per_token": table.host_transfers,
        "steps_per_call": table.steps_per_call, "tokens_per_chunk": table.tokens_per_chunk,
        "decode_loop_in_command_buffer": reading.decode_loop_in_command_buffer,
        "weights_widened": table.widened, "weights_transposed": table.transposed,
        "weight_copies_first": [dataclasses.asdict(c) for c in reading.weight_copies[:4]],
    }
