"""Fused W8A8 products for a GPU decode step: one Pallas (Triton) launch per product.

XLA runs a decode step's W8A8 product (`rollout_dot_general`, AQT's serving path) as three to five
launches: the activations' absmax and their conversion to 8-bit codes (or a normalisation fusion
that also quantizes), a Triton GEMM split over the contraction, and a fusion that sums the splits,
applies the token and channel scales and adds the residual (`bench.explain` on the 1.5B model: 23
launches a layer). At decode sizes a launch moves a few kilobytes to a few megabytes, so a step is
hundreds of launches. `w8a8_product` does one product, with what surrounds it in the layer, in one
launch:

- prologue: the activations x f[M, K] of the block's rows are read whole (the contraction is a few
  thousand elements); optionally RMS-normalised first (`norm`: the layer's input norm before q/k/v);
  their per-token absmax gives the scale; each block of K is quantized as it enters the product.
  Or x arrives already quantized (`x_scale`: codes and their per-token scales, from
  `norm_quantize`, which reads the rows once however many column blocks the product has).
- product: 8-bit x 8-bit on the tensor cores, int8 -> int32 (`mma.sync` / `wgmma ...
  s32.s8.s8`), FP8 E4M3 -> float32; the kernels' codes stored [N, K] (`transpose_for_gpu`: the
  contraction minor, the layout the 8-bit MMA reads), no split over K, so no partial sums to
  reduce.
- epilogue: int32 -> float32 times the token scale, then the channel scale (AQT's order), cast to
  the compute dtype; then a bias per kernel (q/k/v), or the residual added (o_proj, down_proj), or
  silu(gate) * up of two kernels (gate/up).

Several kernels sharing x (q, k, v) run in the one launch: the grid's column blocks are laid end
to end over the kernels, each block computing one kernel's columns.

Numerics follow the reference (AQT's path, then the model's bias / residual / SwiGLU in the
compute dtype) operation by operation: scale = max|x| / max code (0 -> 1; XLA turns the division
by the constant into a product with its float32 reciprocal, and so does this kernel), codes =
round-half-even(clip(x * (1 / scale))), output = (acc * token scale) * channel scale. The
reciprocals are IEEE divisions on the GPU (`div.rn.f32`: Triton's own division is approximate), so
int8 codes and outputs are the reference's bit for bit (tests/test_gpu_kernel.py, in Pallas'
interpreter; FP8 products accumulate in float32 in another order than XLA's dot), except with
`norm`: the sum of squares is taken in another order than XLA's reduction, so the normalised
activations can differ in their last bit and a code by one. Triton's int8 MMAs saturate at
int32 rather than wrap (`.satfinite`): K products of codes of at most 127 stay below 2^31 for any
K under 133,000. `interpret=True` runs the kernel in Pallas' interpreter (CPU tests).

Why a kernel of our own: JAX's maintained GPU Pallas ops (`jax.experimental.pallas.ops.gpu`) have
norms, attention and Mosaic-GPU matmuls (bf16, or bf16 x int8 weight-only on Hopper), none with
8-bit activations quantized per token in the prologue; XLA's Triton GEMM fusions take the
activations' conversion into the GEMM but not their absmax (a reduction), nor the epilogue's split
sums (docs/performance.md).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from qurl_jax.quant._qtensor import QuantizedTensor
from qurl_jax.quant._recipes import QuantFormat

# Streaming multiprocessors of an H100 / H200 SXM: the tile choice fills one wave of them.
GPU_SMS = 132
# tl.dot's smallest tile edge, and the smallest contraction block of the 8-bit MMAs.
_MIN_EDGE, _MIN_DEPTH = 16, 32
# Accumulator elements a block may hold (int32 / float32 in registers, 8 warps).
_MAX_ACC = 128 * 128


@dataclasses.dataclass(frozen=True)
class Tiles:
    """A product's tiling: `rows` x `cols` outputs per block (of each kernel; `swiglu` blocks hold
    two), `depth` contraction elements per step, and the Triton launch's warps and stages."""

    rows: int
    cols: int
    depth: int
    warps: int
    stages: int = 3


def _pow2_divisors(n: int, smallest: int, largest: int) -> list[int]:
    """The powers of two in [smallest, largest] (within 16..512) dividing n, ascending."""
    return [d for d in (1 << i for i in range(4, 10)) if smallest <= d <= largest and n % d == 0]


def choose_tiles(m: int, k: int, ns: Sequence[int], passes: int, x_bytes: int,
                 w_bytes: int, swiglu: bool = False) -> Tiles | None:
    """The tiling of a product of M rows, contraction K and kernels of ns columns whose prologue
    reads a block's activations `passes` times at `x_bytes` an element (`swiglu`: ns is one of
    the two kernels, a block computes both): of the power-of-two tiles
    the kernels' columns and M allow, the one whose busiest streaming multiprocessor reads the
    fewest bytes (activations re-read per column block, weights re-read per row block), in waves
    of `GPU_SMS` blocks. A model for the choice, not a measurement; None where no tile fits (K or
    a kernel's columns not a multiple of 32 / 16, or M not a multiple of 16)."""
    depths = _pow2_divisors(k, _MIN_DEPTH, 128)
    cols = _pow2_divisors(math.gcd(*ns), _MIN_EDGE, 128)
    rows = _pow2_divisors(m, _MIN_EDGE, 128)
    if not depths or not cols or not rows:
        return None
    width = 2 if swiglu else 1
    best = None
    for bm in rows:
        for bn in cols:
            if bm * bn * width > _MAX_ACC:
                continue
            blocks = (m // bm) * sum(n // bn for n in ns)
            per_block = passes * bm * k * x_bytes + width * bn * k * w_bytes
            cost = (math.ceil(blocks / GPU_SMS) * per_block, -bm * bn)
            if best is None or cost < best[0]:
                best = (cost, bm, bn)
    if best is None:
        return None
    _, bm, bn = best
    return Tiles(bm, bn, depths[-1], 8 if bm * bn * width >= 64 * 64 else 4)


def usable(kernel: object) -> bool:
    """Whether `w8a8_product` takes this kernel: a per-output-channel W8A8 `QuantizedTensor`
    (int8 or FP8 E4M3, activations in the same format) stored transposed for the GPU
    (`transpose_for_gpu`), unpacked, 2-D."""
    return (isinstance(kernel, QuantizedTensor) and kernel.act_format is not None
            and kernel.transposed and not kernel.packed and kernel.ndim == 2
            and kernel.is_per_channel(0) and kernel.format is kernel.act_format)


def _round_half_even(x: jax.Array) -> jax.Array:
    """x rounded to the nearest integer, ties to even (`lax.round`'s TO_NEAREST_EVEN, which the
    Triton lowering lacks): x - floor(x) is exact in float32."""
    f = jnp.floor(x)
    d = x - f
    odd = f - 2.0 * jnp.floor(f * 0.5) != 0.0
    return f + jnp.where((d > 0.5) | ((d == 0.5) & odd), 1.0, 0.0)


def _divide(interpret: bool) -> Callable[[jax.Array, jax.Array], jax.Array]:
    """a / b in float32, rounded as IEEE division: XLA's `divide` on the GPU is `div.rn.f32`,
    Triton's the approximate `div.full.f32`, so the kernel asks for the exact one."""
    if interpret:
        return lambda a, b: a / b

    def div(a: jax.Array, b: jax.Array) -> jax.Array:
        a, b = jnp.broadcast_arrays(a, b)
        (out,) = plgpu.elementwise_inline_asm(
            "div.rn.f32 $0, $1, $2;", args=[a, b], constraints="=r,r,r", pack=1,
            result_shape_dtypes=[jax.ShapeDtypeStruct(a.shape, jnp.float32)])
        return out

    return div


@dataclasses.dataclass(frozen=True)
class _Plan:
    """What one launch computes (static): see `w8a8_product`."""

    tiles: Tiles
    k: int
    dtype: jnp.dtype  # the compute dtype (outputs, norm, epilogue)
    code: jnp.dtype  # int8 or float8_e4m3fn
    max_code: float
    kernels: int
    col_blocks: tuple[int, ...]  # column blocks of each kernel (swiglu: of one)
    quantized_input: bool
    norm: float | None  # RMSNorm's eps, or None
    biases: tuple[bool, ...]
    epilogue: str
    interpret: bool


def _quantizer(x_ref, gain_ref, rows: pl.Slice, n_rows: int, k: int, depth: int,
               dtype: jnp.dtype, eps: float | None, code: jnp.dtype, max_code: float,
               interpret: bool):
    """The prologue of a block of `n_rows` rows of x_ref [M, K]: their RMSNorm (with `gain_ref`
    and `eps`; the model's: float32 statistics, gain applied in `dtype`) and AQT's per-token
    calibration, by passes over K in steps of `depth`. Returns (scale f32[n_rows], codes(i): the
    rows' 8-bit codes of contraction block i)."""
    f32 = jnp.float32
    steps = k // depth
    div = _divide(interpret)

    def block(i):
        return x_ref[rows, pl.ds(i * depth, depth)]

    if eps is not None:
        def sum_squares(i, acc):
            x = block(i).astype(f32)
            return acc + jnp.sum(x * x, axis=1)

        ss = jax.lax.fori_loop(0, steps, sum_squares, jnp.zeros((n_rows,), f32))
        rstd = jax.lax.rsqrt(ss * np.float32(1.0 / k) + np.float32(eps))

    def activations(i):  # block i of the product's input, float32
        if eps is None:
            return block(i).astype(f32)
        normed = (block(i).astype(f32) * rstd[:, None]).astype(dtype)
        return (gain_ref[pl.ds(i * depth, depth)].astype(dtype) * normed).astype(f32)

    # max |x| (0 -> 1) / max code (XLA's product with the reciprocal), then its reciprocal
    amax = jax.lax.fori_loop(
        0, steps, lambda i, m: jnp.maximum(m, jnp.max(jnp.abs(activations(i)), axis=1)),
        jnp.zeros((n_rows,), f32))
    scale = jnp.where(amax == 0.0, 1.0, amax) * (np.float32(1.0) / np.float32(max_code))
    inverse = div(jnp.ones_like(scale), scale)
    inverse = jnp.where(jnp.isinf(inverse), 1.0, inverse)

    def codes(i):
        q = jnp.clip(activations(i) * inverse[:, None], -max_code, max_code)
        return (_round_half_even(q) if code == jnp.int8 else q).astype(code)

    return scale, codes


def _kernel(*refs, plan: _Plan) -> None:
    t, k, dt = plan.tiles, plan.k, plan.dtype
    steps = k // t.depth
    refs = list(refs)
    x_ref = refs.pop(0)
    xs_ref = refs.pop(0) if plan.quantized_input else None
    gain_ref = refs.pop(0) if plan.norm is not None else None
    res_ref = refs.pop(0) if plan.epilogue == "residual" else None
    w_refs = [refs.pop(0) for _ in range(plan.kernels)]
    s_refs = [refs.pop(0) for _ in range(plan.kernels)]
    b_refs = [refs.pop(0) if has else None for has in plan.biases]
    out_refs = refs

    div = _divide(plan.interpret)
    rows = pl.ds(pl.program_id(0) * t.rows, t.rows)
    column_block = pl.program_id(1)
    f32 = jnp.float32

    def depth(i):
        return pl.ds(i * t.depth, t.depth)

    if plan.quantized_input:
        scale = xs_ref[rows]
        codes = lambda i: x_ref[rows, depth(i)]  # noqa: E731
    else:
        scale, codes = _quantizer(x_ref, gain_ref, rows, t.rows, k, t.depth, dt, plan.norm,
                                  plan.code, plan.max_code, plan.interpret)

    acc_dtype = jnp.int32 if plan.code == jnp.int8 else f32
    contract = (((1,), (1,)), ((), ()))

    def product(kernels, col0):
        def step(i, accs):
            q = codes(i)
            return tuple(acc + jax.lax.dot_general(q, w_refs[j][pl.ds(col0, t.cols), depth(i)],
                                                   contract, preferred_element_type=acc_dtype)
                         for acc, j in zip(accs, kernels, strict=True))

        zeros = tuple(jnp.zeros((t.rows, t.cols), acc_dtype) for _ in kernels)
        accs = jax.lax.fori_loop(0, steps, step, zeros)
        return [((acc.astype(f32) * scale[:, None]) * s_refs[j][pl.ds(col0, t.cols)][None, :]
                 ).astype(dt) for acc, j in zip(accs, kernels, strict=True)]

    if plan.epilogue == "swiglu":  # silu(gate) * up as XLA computes it, op by op in dt
        col0 = column_block * t.cols
        gate, up = product((0, 1), col0)
        e = jnp.exp(-gate.astype(f32)).astype(dt)
        sigmoid = div(jnp.ones(e.shape, f32), (e + jnp.ones((), dt)).astype(f32)).astype(dt)
        out_refs[0][rows, pl.ds(col0, t.cols)] = (gate * sigmoid) * up
        return
    first = 0
    for j, blocks in enumerate(plan.col_blocks):
        @pl.when((column_block >= first) & (column_block < first + blocks))
        def _(j=j, first=first):
            col0 = (column_block - first) * t.cols
            (y,) = product((j,), col0)
            if b_refs[j] is not None:
                y = y + b_refs[j][pl.ds(col0, t.cols)].astype(dt)
            if res_ref is not None:
                y = res_ref[rows, pl.ds(col0, t.cols)].astype(dt) + y
            out_refs[j][rows, pl.ds(col0, t.cols)] = y.astype(out_refs[j].dtype)

        first += blocks


def w8a8_product(x: jax.Array, kernels: Sequence[QuantizedTensor], *,
                 x_scale: jax.Array | None = None, norm: tuple[jax.Array, float] | None = None,
                 biases: Sequence[jax.Array | None] | None = None,
                 residual: jax.Array | None = None, swiglu: bool = False,
                 dtype: jnp.dtype | None = None, interpret: bool = False,
                 tiles: Tiles | None = None) -> tuple[jax.Array, ...]:
    """The W8A8 products x @ kernel for each kernel, with their prologue and epilogue, in one
    launch (module docstring).

    x: f[M, K] activations in the compute dtype, or with `x_scale` f32[M] their 8-bit codes
      (per-token scales from AQT's quantizer).
    kernels: `usable` QuantizedTensors [K, N_i] (stored [N_i, K]), all in one 8-bit format.
    norm: (gain f[K], eps): x is the residual stream, RMS-normalised here first.
    biases: one f[N_i] or None per kernel, added in the compute dtype.
    residual: f[M, N] added to the (one) kernel's output.
    swiglu: two kernels (gate, up) of equal N: the one output silu(gate) * up.
    dtype: the compute dtype (default: x's; required with `x_scale`).
    Returns one f[M, N_i] per kernel in `dtype` (one output with `residual` or `swiglu`).
    ValueError naming what does not fit (shapes without a tiling, a kernel not `usable`).
    """
    if not kernels or not all(usable(w) for w in kernels):
        raise ValueError("w8a8_product: kernels must be per-channel W8A8 QuantizedTensors "
                         "stored transposed for the GPU (quant.transpose_for_gpu)")
    stored = [w.stored() for w in kernels]  # codes [N_i, K], scales [N_i, 1]
    m, k = x.shape
    ns = tuple(w.qvalue.shape[0] for w in stored)
    fmt = kernels[0].format
    if any(w.format is not fmt for w in kernels) or any(w.qvalue.shape[1] != k for w in stored):
        raise ValueError(f"w8a8_product: kernels of one format contracting x's {k} columns; got "
                         f"{[(w.format.name, w.shape) for w in kernels]}")
    epilogue = "swiglu" if swiglu else "residual" if residual is not None else "plain"
    if (swiglu and (len(kernels) != 2 or ns[0] != ns[1])) or (
            residual is not None and (len(kernels) != 1 or residual.shape != (m, ns[0]))):
        need = "two kernels of equal columns" if swiglu else "one kernel, a residual f[M, N]"
        raise ValueError(f"w8a8_product: {epilogue} needs {need}; got kernels "
                         f"{[w.shape for w in kernels]}")
    quantized = x_scale is not None
    if quantized and dtype is None:
        raise ValueError("w8a8_product: codes in (x_scale given) need the compute dtype `dtype`")
    dt = jnp.dtype(dtype or x.dtype)
    if quantized and x.dtype != fmt.dtype:
        raise ValueError(f"w8a8_product: codes of x are {x.dtype}, the kernels' {fmt.dtype}")
    passes = 1 if quantized else 2 + (norm is not None)
    tiles = tiles or choose_tiles(m, k, ns[:1] if swiglu else ns, passes, x.dtype.itemsize, 1,
                                  swiglu)
    if tiles is None:
        raise ValueError(f"w8a8_product: no tiling for x [{m}, {k}] and kernels of {ns} columns "
                         "(M a multiple of 16, K of 32, N of 16)")
    biases = tuple(biases) if biases is not None else (None,) * len(kernels)
    plan = _Plan(tiles, k, dt, jnp.dtype(fmt.dtype), fmt.max_code, len(kernels),
                 tuple(n // tiles.cols for n in ns), quantized,
                 None if norm is None else float(norm[1]),
                 tuple(b is not None for b in biases), epilogue, interpret)
    args = [x]
    if quantized:
        args.append(x_scale.astype(jnp.float32))
    if norm is not None:
        args.append(norm[0])
    if residual is not None:
        args.append(residual)
    args += [w.qvalue for w in stored]
    args += [w.scale.reshape(-1) for w in stored]
    args += [b for b in biases if b is not None]
    outputs = [jax.ShapeDtypeStruct((m, ns[0] if swiglu or residual is not None else n), dt)
               for n in (ns[:1] if swiglu or residual is not None else ns)]
    col_blocks = plan.col_blocks[0] if swiglu else sum(plan.col_blocks)
    out = pl.pallas_call(
        functools.partial(_kernel, plan=plan), out_shape=outputs,
        grid=(m // tiles.rows, col_blocks),
        compiler_params=plgpu.CompilerParams(num_warps=tiles.warps, num_stages=tiles.stages),
        interpret=interpret, name=f"w8a8_{epilogue}{'_norm' if norm is not None else ''}",
    )(*args)
    return tuple(out)


def norm_quantize(x: jax.Array, gain: jax.Array, eps: float, fmt: QuantFormat, *,
                  interpret: bool = False, rows: int = 16) -> tuple[jax.Array, jax.Array]:
    """The model's RMSNorm of x f[M, K] (gain f[K]) quantized per token as AQT's quantizer does
    it (`quantize_groups` over K), in one launch: XLA makes it two (the normalisation fusion
    cannot hold the norm's reduction and the absmax's one after it, so it computes the scales,
    then normalises again to quantize). Returns (codes [M, K] in fmt's dtype, f32[M] scales).
    M a multiple of `rows` (16), K of 32."""
    m, k = x.shape
    depth = _pow2_divisors(k, _MIN_DEPTH, 128)
    if m % rows or not depth:
        raise ValueError(f"norm_quantize: x [{m}, {k}] needs M a multiple of {rows} and K of 32")
    depth = depth[-1]
    code = jnp.dtype(fmt.dtype)

    def kernel(x_ref, gain_ref, codes_ref, scale_ref):
        block = pl.ds(pl.program_id(0) * rows, rows)
        scale, codes = _quantizer(x_ref, gain_ref, block, rows, k, depth, x.dtype, eps, code,
                                  fmt.max_code, interpret)

        def write(i, carry):
            codes_ref[block, pl.ds(i * depth, depth)] = codes(i)
            return carry

        jax.lax.fori_loop(0, k // depth, write, 0)
        scale_ref[block] = scale

    return pl.pallas_call(
        kernel, grid=(m // rows,), out_shape=[jax.ShapeDtypeStruct((m, k), code),
                                              jax.ShapeDtypeStruct((m,), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=1), interpret=interpret,
        name="rms_norm_quantize")(x, gain)


# ------------------------------------------------------------------------------ a decode layer
_ATTENTION_IN = ("q_proj", "k_proj", "v_proj")
_LINEAR_KEYS = ({"kernel"}, {"kernel", "bias"})
# Everything an attention block may hold (Qwen3's q/k norms run in the model's attention).
_ATTENTION_KEYS = {*_ATTENTION_IN, "o_proj", "q_norm", "k_norm"}


@dataclasses.dataclass(frozen=True)
class FusedDecode:
    """A decode step's products on the GPU, one launch each (`Transformer(fused_decode=...)`;
    `models.transformer.DecoderLayer` calls it where `applies` says the layer's parameters are
    what it takes, else runs its own products):

    - `attention_in`: the input RMSNorm, then q, k, v with their biases (one launch);
    - `attention_out`: o_proj of the attention's output plus the residual (one launch);
    - `mlp`: the post-attention RMSNorm quantized per token (`norm_quantize`, one launch), gate
      and up of it with silu(gate) * up (one launch), down_proj plus the residual (one launch).

    interpret: run the kernels in Pallas' interpreter (CPU tests).
    mesh, row_spec: on a mesh, each kernel runs per batch shard (`jax.shard_map`: XLA does not
      partition a Pallas call), rows by `row_spec(shape)` (a PartitionSpec for an array whose
      leading axis is the rows) and the weights whole on every device (`applies` needs the mesh
      without a tensor axis larger than 1).
    Rows per shard that are not a multiple of 16 are padded to one (an XLA pad).
    """

    interpret: bool = False
    mesh: jax.sharding.Mesh | None = None
    row_spec: Callable[[tuple[int, ...]], jax.sharding.PartitionSpec] | None = None

    def applies(self, layer: dict) -> bool:
        """Whether a decoder layer's parameters (`layers_i`) are what the kernels take: the seven
        linear kernels `usable`, in one format, with no parameter beside them but q/k/v biases
        (LoRA adapters, for one, are not fused), and tiles for their shapes."""
        try:
            attn, mlp = layer["self_attn"], layer["mlp"]
            linears = [attn[n] for n in (*_ATTENTION_IN, "o_proj")] + [
                mlp[n] for n in ("gate_proj", "up_proj", "down_proj")]
            gains = layer["input_layernorm"]["scale"], layer["post_attention_layernorm"]["scale"]
        except (KeyError, TypeError):
            return False
        if set(mlp) != {"gate_proj", "up_proj", "down_proj"} or not set(attn) <= _ATTENTION_KEYS \
                or any(set(p) not in _LINEAR_KEYS for p in linears) or any(
                "bias" in p for p in linears[3:]) or not all(usable(p["kernel"]) for p in linears):
            return False
        kernels = [p["kernel"] for p in linears]
        if len({w.format for w in kernels}) != 1 or (self.mesh is not None and dict(
                self.mesh.shape).get("tensor", 1) > 1):
            return False
        hidden, inner = kernels[0].shape[0], kernels[4].shape[1]
        contractions = (hidden, inner, kernels[3].shape[0])  # o_proj's: heads x head_dim
        shapes_fit = all(k % _MIN_DEPTH == 0 for k in contractions) and all(
            w.shape[1] % _MIN_EDGE == 0 for w in kernels)
        return shapes_fit and all(g.shape == (hidden,) for g in gains) and (
            kernels[3].shape == (kernels[0].shape[1], hidden)
            and kernels[4].shape == kernels[5].shape == (hidden, inner)
            and kernels[6].shape == (inner, hidden))

    def attention_in(self, x: jax.Array, gain: jax.Array, eps: float,
                     projections: Sequence[dict]) -> tuple[jax.Array, ...]:
        """x f[B, T, E] the residual stream; gain f[E] the input norm's; projections the q/k/v
        Linear parameters. Returns q, k, v f[B, T, N_i]."""
        kernels = [p["kernel"] for p in projections]
        biases = [p.get("bias") for p in projections]
        return self._run(lambda x, g, ws, bs: w8a8_product(
            x, ws, norm=(g, eps), biases=bs, interpret=self.interpret), x, (), gain,
            kernels, biases)

    def attention_out(self, out: jax.Array, o_proj: dict, residual: jax.Array) -> jax.Array:
        """residual + out @ o_proj: out f[B, T, H*D], residual f[B, T, E] -> f[B, T, E]."""
        (y,) = self._run(lambda x, r, w: w8a8_product(x, [w], residual=r, interpret=self.interpret),
                         out, (residual,), o_proj["kernel"])
        return y

    def mlp(self, x: jax.Array, gain: jax.Array, eps: float, mlp: dict) -> jax.Array:
        """x + down(silu(gate(h)) * up(h)), h = the post-attention RMSNorm of x (gain f[E]):
        x f[B, T, E] the residual stream, mlp the MLP's parameters -> f[B, T, E]."""
        gate, up, down = (mlp[n]["kernel"] for n in ("gate_proj", "up_proj", "down_proj"))

        def gated(x, g, ws):
            codes, scale = norm_quantize(x, g, eps, gate.act_format, interpret=self.interpret)
            return w8a8_product(codes, ws, x_scale=scale, swiglu=True, dtype=x.dtype,
                                interpret=self.interpret)

        (inner,) = self._run(gated, x, (), gain, [gate, up])
        (y,) = self._run(lambda h, r, w: w8a8_product(h, [w], residual=r, interpret=self.interpret),
                         inner, (x,), down)
        return y

    def _run(self, fn: Callable, x: jax.Array, rows: tuple[jax.Array, ...], *weights: object
             ) -> tuple[jax.Array, ...]:
        """fn(x, *rows, *weights) over x's and `rows`' leading axes flattened into rows (padded
        to a multiple of 16), per batch shard on a mesh; each output back to x's leading axes."""

        def local(x: jax.Array, *args: object) -> tuple[jax.Array, ...]:
            flat = [a.reshape(-1, a.shape[-1]) for a in (x, *args[:len(rows)])]
            m = flat[0].shape[0]
            if m % _MIN_EDGE:
                flat = [jnp.pad(a, ((0, -m % _MIN_EDGE), (0, 0))) for a in flat]
            return tuple(y[:m].reshape(*x.shape[:-1], y.shape[-1])
                         for y in fn(*flat, *args[len(rows):]))

        if self.mesh is None or self.mesh.size == 1:
            return local(x, *rows, *weights)
        spec = self.row_spec
        whole = jax.sharding.PartitionSpec()
        return jax.shard_map(local, mesh=self.mesh,
                             in_specs=(spec(x.shape), *(spec(r.shape) for r in rows),
                                       *(whole for _ in weights)),
                             out_specs=spec(x.shape), check_vma=False)(x, *rows, *weights)
