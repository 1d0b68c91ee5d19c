"""bench.collectives: the collectives a compiled program's decode loop runs per iteration."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from qurl_jax.plan import collectives
from tests.compile_only import compiler_or_skip

# A hand-written module in the printed form of XLA's optimized HLO: an outer loop with one dot
# and an all-gather (the async pair), the decode-like loop with three dots, which holds a fused
# all-reduce of two buffers, a conditional whose branch all-reduces, an async-wrapped
# reduce-scatter, and a nested loop of known trip count 3 holding a collective-permute.
HLO = """HloModule jit_f, is_scheduled=true

%add (a: f32[], b: f32[]) -> f32[] {
  %a = f32[] parameter(0)
  %b = f32[] parameter(1)
  ROOT %s = f32[] add(%a, %b)
}

%fused_dot (p0: f32[8,64], p1: f32[64,64]) -> f32[8,64] {
  %p0 = f32[8,64]{1,0} parameter(0)
  %p1 = f32[64,64]{1,0} parameter(1)
  ROOT %dot.1 = f32[8,64]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
}

%branch_a (q: f32[8,64]) -> f32[8,64] {
  %q = f32[8,64]{1,0} parameter(0)
  ROOT %ar.b = f32[8,64]{1,0} all-reduce(%q), replica_groups={{0,1},{2,3}}, to_apply=%add
}

%branch_b (r: f32[8,64]) -> f32[8,64] {
  ROOT %r = f32[8,64]{1,0} parameter(0)
}

%wrapped_rs (w: bf16[8,64]) -> bf16[2,64] {
  %w = bf16[8,64]{1,0} parameter(0)
  ROOT %rs = bf16[2,64]{1,0} reduce-scatter(%w), replica_groups=[1,4]<=[4], dimensions={0}, to_apply=%add
}

%inner_body (t: (s32[], f32[8,64])) -> (s32[], f32[8,64]) {
  %t = (s32[], f32[8,64]{1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %v = f32[8,64]{1,0} get-tuple-element(%t), index=1
  %cp = f32[8,64]{1,0} collective-permute(%v), source_target_pairs={{0,1},{1,0}}
  ROOT %o = (s32[], f32[8,64]{1,0}) tuple(%i, %cp)
}

%inner_cond (t2: (s32[], f32[8,64])) -> pred[] {
  %t2 = (s32[], f32[8,64]{1,0}) parameter(0)
  ROOT %c = pred[] constant(true)
}

%decode_body (d: (s32[], f32[8,64], f32[64,64], pred[])) -> (s32[], f32[8,64], f32[64,64], pred[]) {
  %d = (s32[], f32[8,64]{1,0}, f32[64,64]{1,0}, pred[]) parameter(0)
  %x = f32[8,64]{1,0} get-tuple-element(%d), index=1
  %w1 = f32[64,64]{1,0} get-tuple-element(%d), index=2
  %pr = pred[] get-tuple-element(%d), index=3
  %f1 = f32[8,64]{1,0} fusion(%x, %w1), kind=kOutput, calls=%fused_dot
  %f2 = f32[8,64]{1,0} fusion(%f1, %w1), kind=kOutput, calls=%fused_dot
  %d3 = f32[8,64]{1,0} dot(%f2, %w1), lhs_contracting_dims={1}, rhs_contracting_dims={0}
  %ar = (f32[8,64]{1,0}, s32[8,1024]{1,0}) all-reduce(%f1, %f2), replica_groups=mesh['a'=2,'b'=4] {'b'}, to_apply=%add, metadata={op_name="x calls=%add"}
  %g0 = f32[8,64]{1,0} get-tuple-element(%ar), index=0
  %cond = f32[8,64]{1,0} conditional(%pr, %g0, %g0), branch_computations={%branch_a, %branch_b}
  %cv = bf16[8,64]{1,0} convert(%cond)
  %as = ((bf16[8,64]{1,0}), bf16[2,64]{1,0}) async-start(%cv), calls=%wrapped_rs
  %ad = bf16[2,64]{1,0} async-done(%as), calls=%wrapped_rs
  %init = (s32[], f32[8,64]{1,0}) tuple(%i0, %d3)
  %loop = (s32[], f32[8,64]{1,0}) while(%init), condition=%inner_cond, body=%inner_body, backend_config={"known_trip_count":{"n":"3"}}
  ROOT %out = (s32[], f32[8,64]{1,0}, f32[64,64]{1,0}, pred[]) tuple(%i0, %d3, %w1, %pr)
}

%decode_cond (e: (s32[], f32[8,64], f32[64,64], pred[])) -> pred[] {
  %e = (s32[], f32[8,64]{1,0}, f32[64,64]{1,0}, pred[]) parameter(0)
  ROOT %c2 = pred[] constant(true)
}

%outer_body (o: (s32[], f32[2,64], f32[64,64])) -> (s32[], f32[2,64], f32[64,64]) {
  %o = (s32[], f32[2,64]{1,0}, f32[64,64]{1,0}) parameter(0)
  %y = f32[2,64]{1,0} get-tuple-element(%o), index=1
  %ag = (f32[2,64]{1,0}, f32[8,64]{1,0}) all-gather-start(%y), replica_groups=[2,4]<=[8], dimensions={0}
  %agd = f32[8,64]{1,0} all-gather-done(%ag)
  %one = f32[8,64]{1,0} fusion(%agd, %agd), kind=kOutput, calls=%fused_dot
  ROOT %oo = (s32[], f32[2,64]{1,0}, f32[64,64]{1,0}) tuple(%i1, %y, %w2)
}

ENTRY %main (p: f32[2,64], w: f32[64,64]) -> f32[8,64] {
  %p = f32[2,64]{1,0} parameter(0)
  %w = f32[64,64]{1,0} parameter(1)
  %t0 = (s32[], f32[2,64]{1,0}, f32[64,64]{1,0}) tuple(%z, %p, %w)
  %outer = (s32[], f32[2,64]{1,0}, f32[64,64]{1,0}) while(%t0), condition=%decode_cond, body=%outer_body
  %t1 = (s32[], f32[8,64]{1,0}, f32[64,64]{1,0}, pred[]) tuple(%z, %q0, %w, %pr0)
  %decode = (s32[], f32[8,64]{1,0}, f32[64,64]{1,0}, pred[]) while(%t1), condition=%decode_cond, body=%decode_body
  ROOT %r = f32[8,64]{1,0} get-tuple-element(%decode), index=1
}
"""  # noqa: E501


def test_reads_every_collective_of_the_loop_with_the_most_dots() -> None:
    found = collectives.loop_body_collectives(HLO)
    kinds = [c.kind for c in found]
    # the branch's all-reduce, the combined one, the wrapped reduce-scatter (once, not again
    # at its async-done), the inner loop's permute once per trip
    assert sorted(kinds) == sorted(["all-reduce", "all-reduce", "reduce-scatter"]
                                   + ["collective-permute"] * 3)
    combined = next(c for c in found if c.name == "ar")
    assert combined.bytes == 8 * 64 * 4 + 8 * 1024 * 4  # both buffers
    assert combined.first_buffer_bytes == 8 * 64 * 4
    assert (combined.dtype, combined.shape, combined.group) == ("s32", (8, 1024), 4)
    branch = next(c for c in found if c.name == "ar.b")
    assert branch.group == 2 and branch.link_bytes == branch.bytes  # 2 x (2-1)/2
    rs = next(c for c in found if c.kind == "reduce-scatter")
    assert (rs.bytes, rs.group) == (8 * 64 * 2, 4)  # its input, the larger side
    assert rs.link_bytes == pytest.approx(rs.bytes * 3 / 4)
    summary = collectives.summarize(found)
    count, nbytes, by_kind = summary
    assert count == 6 and by_kind["collective-permute"] == (3, 3 * 8 * 64 * 4)
    assert nbytes == sum(c.bytes for c in found)
    assert summary.first_buffer_bytes == nbytes - 8 * 1024 * 4


def test_pallas_kernels_of_the_decode_loop_are_counted_per_iteration() -> None:
    assert collectives.loop_body_kernels(HLO) == 0
    # A Triton kernel (JAX's GPU Pallas decode attention) in the inner loop (3 trips) and a
    # Mosaic one in the body; another custom call is not a kernel.
    kernel = ('  %{n} = f32[8,64]{{1,0}} custom-call(%v), custom_call_target="{t}", '
              'backend_config={{name = "mha_forward"}}\n')
    hlo = HLO.replace("  %cp = f32[8,64]", kernel.format(n="k1", t="__gpu$xla.gpu.triton")
                      + "  %cp = f32[8,64]")
    hlo = hlo.replace("  %cv = bf16", kernel.format(n="k2", t="tpu_custom_call")
                      + kernel.format(n="k3", t="Sharding") + "  %cv = bf16")
    assert collectives.loop_body_kernels(hlo) == 3 + 1
    assert collectives.loop_body_kernels(hlo, while_name="outer") == 0


def test_the_body_alone_misses_what_its_calls_run() -> None:
    found = collectives.loop_body_collectives(HLO, follow_calls=False)
    assert [c.name for c in found] == ["ar"]


def test_a_named_loop_and_async_pairs_counted_once() -> None:
    found = collectives.loop_body_collectives(HLO, while_name="outer")
    assert [(c.kind, c.shape, c.bytes, c.group) for c in found] == [
        ("all-gather", (8, 64), 8 * 64 * 4, 4)]  # the gathered result, from the -done
    assert collectives.loop_body_collectives(HLO, body="outer_body") == found
    with pytest.raises(collectives.HloError, match="no while named 'nope'"):
        collectives.loop_body_collectives(HLO, while_name="nope")
    with pytest.raises(collectives.HloError, match="no while loop"):
        collectives.loop_body_collectives("HloModule m\n\nENTRY %e (a: f32[]) -> f32[] {\n"
                                          "  ROOT %a = f32[] parameter(0)\n}\n")


def test_a_loop_that_only_wraps_the_decode_loop_ties_and_loses() -> None:
    wrapped = HLO.replace(
        "ENTRY %main", "%wrap_body (u: (s32[], f32[8,64], f32[64,64], pred[])) -> "
        "(s32[], f32[8,64], f32[64,64], pred[]) {\n"
        "  %u = (s32[], f32[8,64]{1,0}, f32[64,64]{1,0}, pred[]) parameter(0)\n"
        "  ROOT %inner = (s32[], f32[8,64]{1,0}, f32[64,64]{1,0}, pred[]) while(%u), "
        "condition=%decode_cond, body=%decode_body\n}\n\nENTRY %main").replace(
        "body=%decode_body\n  ROOT %r", "body=%wrap_body\n  ROOT %r")
    module = collectives.parse(wrapped)
    assert collectives.decode_loop(module).name == "inner"
    assert collectives.loop_body_collectives(module) == collectives.loop_body_collectives(HLO)


def test_describe_names_the_biggest_operands() -> None:
    lines = collectives.describe(collectives.loop_body_collectives(HLO), top=2)
    assert lines[0].startswith("6 collectives")
    assert lines[-3:] == ["  biggest:", "    1 x all-reduce s32[8,1024]: 0.03 MiB",
                          "    3 x collective-permute f32[8,64]: 0.01 MiB"]
    assert collectives.to_json([])["count"] == 0


def _program(devices: list, layers: int = 4) -> str:
    """A decode-like program: a loop of one dot (no collective), then a loop of `layers` dots
    on weights sharded over their contracting dimension (one all-reduce of the rows per layer)."""
    mesh = Mesh(np.array(devices), ("x",), axis_types=(AxisType.Auto,))

    def f(w, x, n):
        def small(carry):
            i, y = carry
            return i + 1, y @ jnp.eye(64, dtype=y.dtype)

        def step(carry):
            i, y = carry
            for layer in range(layers):
                y = jnp.tanh(y @ w[layer])
            return i + 1, y

        _, x = jax.lax.while_loop(lambda c: c[0] < n, small, (0, x))
        return jax.lax.while_loop(lambda c: c[0] < n, step, (0, x))[1]

    args = (jax.ShapeDtypeStruct((layers, 64, 64), jnp.float32,
                                 sharding=NamedSharding(mesh, P(None, "x", None))),
            jax.ShapeDtypeStruct((16, 64), jnp.float32, sharding=NamedSharding(mesh, P())),
            jax.ShapeDtypeStruct((), jnp.int32, sharding=NamedSharding(mesh, P())))
    lowered = jax.jit(f, out_shardings=NamedSharding(mesh, P())).lower(*args)
    return lowered.compile().as_text()


@pytest.mark.parametrize("target", ["cpu", "tpu:v5e-4"])
def test_compiled_decode_loop_all_reduces_once_per_layer(target: str) -> None:
    devices = jax.devices()[:8] if target == "cpu" else compiler_or_skip(target).devices()
    text = _program(devices)
    module = collectives.parse(text)
    assert sorted(dots for _, _, dots in collectives.loops(module)) == [1, 4]
    found = collectives.loop_body_collectives(module)
    assert [(c.kind, c.dtype, c.shape, c.group) for c in found] == [
        ("all-reduce", "f32", (16, 64), len(devices))] * 4
    n = len(devices)
    assert collectives.summarize(found).link_bytes == pytest.approx(
        4 * 16 * 64 * 4 * 2 * (n - 1) / n)


# A decode loop over an 8-bit cache s8[2,4,8,16] (1024 elements a layer): a fusion that
# dequantizes the whole cache to bf16 (one written array, its inner convert not a second), an
# in-place update of the cache and views of it (not written), a nested loop of 2 trips whose
# body broadcasts scales to the cache's shape (twice), and arrays of other sizes.
FLOAT_COPIES = """HloModule jit_decode, is_scheduled=true

%dequant (c: s8[2,4,8,16], s: f32[2,4,8]) -> bf16[2,4,8,16] {
  %c = s8[2,4,8,16]{3,2,1,0} parameter(0)
  %s = f32[2,4,8]{2,1,0} parameter(1)
  %cf = bf16[2,4,8,16]{3,2,1,0} convert(%c)
  %sb = bf16[2,4,8,16]{3,2,1,0} broadcast(%s), dimensions={0,1,2}
  ROOT %m = bf16[2,4,8,16]{3,2,1,0} multiply(%cf, %sb)
}

%scales_body (t: (s32[], f32[2,4,8])) -> (s32[], f32[2,4,8]) {
  %t = (s32[], f32[2,4,8]{2,1,0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %v = f32[2,4,8]{2,1,0} get-tuple-element(%t), index=1
  %bc = f32[2,4,8,16]{3,2,1,0} broadcast(%v), dimensions={0,1,2}
  ROOT %o = (s32[], f32[2,4,8]{2,1,0}) tuple(%i, %v)
}

%cond (e: (s32[], f32[2,4,8])) -> pred[] {
  %e = (s32[], f32[2,4,8]{2,1,0}) parameter(0)
  ROOT %c2 = pred[] constant(true)
}

%body (d: (s32[], s8[2,4,8,16], f32[2,4,8], f32[8,64])) -> (s32[], s8[2,4,8,16], f32[2,4,8], f32[8,64]) {
  %d = (s32[], s8[2,4,8,16]{3,2,1,0}, f32[2,4,8]{2,1,0}, f32[8,64]{1,0}) parameter(0)
  %k = s8[2,4,8,16]{3,2,1,0} get-tuple-element(%d), index=1
  %ks = f32[2,4,8]{2,1,0} get-tuple-element(%d), index=2
  %x = f32[8,64]{1,0} get-tuple-element(%d), index=3
  %new = s8[2,4,1,16]{3,2,1,0} constant({...})
  %k2 = s8[2,4,8,16]{3,2,1,0} dynamic-update-slice(%k, %new, %z, %z, %z, %z)
  %kf = bf16[2,4,8,16]{3,2,1,0} fusion(%k2, %ks), kind=kLoop, calls=%dequant
  %att = f32[2,4,16]{2,1,0} custom-call(%kf), custom_call_target="__gpu$xla.gpu.triton"
  %y = f32[8,64]{1,0} dot(%x, %x), lhs_contracting_dims={1}, rhs_contracting_dims={1}
  %y2 = f32[8,64]{1,0} fusion(%y), kind=kLoop, calls=%dequant
  %init = (s32[], f32[2,4,8]{2,1,0}) tuple(%z, %ks)
  %scales = (s32[], f32[2,4,8]{2,1,0}) while(%init), condition=%cond, body=%scales_body, backend_config={"known_trip_count":{"n":"2"}}
  ROOT %out = (s32[], s8[2,4,8,16]{3,2,1,0}, f32[2,4,8]{2,1,0}, f32[8,64]{1,0}) tuple(%z, %k2, %ks, %y)
}

ENTRY %main (p: (s32[], s8[2,4,8,16], f32[2,4,8], f32[8,64])) -> f32[8,64] {
  %p = (s32[], s8[2,4,8,16]{3,2,1,0}, f32[2,4,8]{2,1,0}, f32[8,64]{1,0}) parameter(0)
  %loop = (s32[], s8[2,4,8,16]{3,2,1,0}, f32[2,4,8]{2,1,0}, f32[8,64]{1,0}) while(%p), condition=%cond, body=%body
  ROOT %r = f32[8,64]{1,0} get-tuple-element(%loop), index=3
}
"""  # noqa: E501


def test_float_arrays_of_a_layers_cache_size_the_decode_loop_writes() -> None:
    found = collectives.loop_body_float_arrays(FLOAT_COPIES, 2 * 4 * 8 * 16)
    assert found == [("kf", "bf16[2,4,8,16]", 2048)] + [("bc", "f32[2,4,8,16]", 4096)] * 2
    # Another size: only arrays of exactly that many elements (the dot and the fusion after it;
    # the views of x are not written).
    assert collectives.loop_body_float_arrays(FLOAT_COPIES, 8 * 64) == [
        ("y", "f32[8,64]", 2048), ("y2", "f32[8,64]", 2048)]
    assert collectives.loop_body_float_arrays(FLOAT_COPIES, 2 * 4 * 8) == []
