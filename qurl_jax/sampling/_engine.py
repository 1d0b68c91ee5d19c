"""The sampling engine: the programs' building blocks and the decode state, for both samplers.

`Engine` holds one model configuration's models, cache layout (`_cache.py`) and sharding, and
offers the pieces the host drivers compose into jitted programs:

    prefill   the prompts' forward into their cache (last-position logits, cache)
    admit     rows into slots of a `DecodeState`: each row's first token sampled from its prompt's
              logits, its counters and random stream set (the cache rows are the layout's `admit`)
    step      ONE decode step for every slot: the last token through the model (KV write, and a
              compressed layout's window; optionally its compression), the next token sampled
              with its log-probs and written into the row-indexed outputs, the finish bookkeeping
              (EOS or the row's length limit)
    finish    per-row lengths and finish reasons (`finish_reasons`, the one rule)

`Sampler` (`_static.py`) runs chunks of rows start to end; `RefillSampler` (`_refill.py`)
refills finished slots with waiting rows. Both run these same pieces, so they return the same
tokens and log-probs for the same key: row i draws its token t with `fold_in(fold_in(key, i), t)`
whatever chunk or slot it lands in.

The same code path serves full-precision parameters and quantized rollout parameters: the
model's `dot_general` hook and the parameter pytree are supplied from outside (`qurl_jax.quant`).
Under a mesh rows are sharded over ('data', 'fsdp') and the cache's kv heads over 'tensor';
parameters are expected to be placed already (`qurl_jax.parallel.sharding.shard_params`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from qurl_jax.cpu_kernels import decode_attention as cpu_attention
from qurl_jax.models import decode_attention as ragged
from qurl_jax.models import exact as exact_lib
from qurl_jax.models import kv_quant
from qurl_jax.models.config import ModelConfig
from qurl_jax.models.kv_quant import KVPrecision
from qurl_jax.models.params import token_logprobs
from qurl_jax.models.transformer import (
    DecodeAttention,
    DotGeneral,
    PagedAttention,
    PagedScatter,
    RowScale,
    Transformer,
    cast_floats,
    put_tokens,
)
from qurl_jax.parallel.sharding import activation_pinner, logical_to_mesh_spec
from qurl_jax.parallel.targets import platform_of
from qurl_jax.quant import (
    FusedDecode,
    QuantizedTensor,
    pack_for_decode,
    packs_for_decode,
    transpose_for_gpu,
)
from qurl_jax.sampling._cache import Cache, Paging, cache_layout
from qurl_jax.sampling._distributions import SamplingMode, sample_tokens
from qurl_jax.sampling._host import (
    ROW_AXES,
    Params,
    RowSharding,
    bucket,
    check_buckets,
    check_prompts,
    power_of_two_buckets,
)
from qurl_jax.sampling._kv_policy import KVPolicyConfig
from qurl_jax.sampling._output import finish_reasons
from qurl_jax.sampling.settings import Decoding, SamplingParams

DECODE_ATTENTION = ("auto", "xla", "pallas")  # `Engine.decode_attention` choices
FUSED_PRODUCTS = ("auto", "off", "on", "interpret")  # `Engine.fused_products` choices
_OUT_AXES = ("batch", "cache_length")  # row-indexed output buffers [N, G]: rows over the batch axes
# Decode steps per iteration of a GPU decode loop (`Engine.decode_while`).
GPU_DECODE_CHUNK = 16
# XLA's command types a GPU decode program records into command buffers (CUDA graphs): XLA's
# default list (FUSION, CUBLAS, CUBLASLT, CUSTOM_CALL, CUDNN, DYNAMIC_SLICE_FUSION) and the loops
# and conditionals, so a chunk of decode steps is one graph whose loop runs on the device. Per
# program (`compiler_options`), a full list: the '+WHILE' form of XLA_FLAGS is refused there
# ("'+WHILE' is not a valid enum value", jaxlib 0.10.2). `Engine.compiler_options`.
GPU_COMMAND_BUFFER = ("FUSION,CUBLAS,CUBLASLT,CUSTOM_CALL,CUDNN,DYNAMIC_SLICE_FUSION,WHILE,"
                      "CONDITIONAL")


@dataclasses.dataclass(frozen=True)
class _PerShardPaged:
    """A paged attention hook that runs per batch shard, and its pool write (the model's
    `PagedScatter`, found as `write`) and per-sequence scale read (`RowScale`, found as
    `row_scale`) run the same way."""

    attend: Callable[..., jax.Array]
    write: PagedScatter
    row_scale: RowScale

    def __call__(self, *args: jax.Array, **scales: jax.Array) -> jax.Array:
        return self.attend(*args, **scales)


@flax.struct.dataclass
class DecodeState:
    """R row slots being decoded and the row-indexed outputs of N rows (G = generation bucket).

    cache: the layout's cache of R rows (`CacheLayout.slots(p_len, g_len)` slots each).
    tok: i32[R]        each slot's last sampled token (the next step's input).
    step: i32[R]       tokens its occupant has generated (the output column of its next token).
    live: bool[R]      the slot holds a row that is still generating.
    row: i32[R]        its occupant's output row; N when never filled.
    stream: i32[R]     its occupant's random stream (its row in a one-process call).
    limit: i32[R]      its occupant's response length limit.
    tokens: i32[N, G]; logp, logp_untruncated: f32[N, G]; mask: bool[N, G] - `SampleOutput`'s
                       per-token fields, written in place as tokens are sampled.
    """

    cache: Cache
    tok: jax.Array
    step: jax.Array
    live: jax.Array
    row: jax.Array
    stream: jax.Array
    limit: jax.Array
    tokens: jax.Array
    logp: jax.Array
    logp_untruncated: jax.Array
    mask: jax.Array

    @property
    def slots(self) -> int:
        return self.live.shape[0]

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]


@functools.cache
def _warn_float_copy(devices: str, paged: bool, kv_scale: str) -> None:
    """Once per process: where JAX's kernel for this cache takes no 8-bit codes, the decode loop
    writes a float array as large as each layer's cache every step (read from the compiled
    programs: `plan.collectives.loop_body_float_arrays`, docs/paged_kv.md)."""
    if devices == "gpu" and not paged:
        what = ("JAX's dense GPU decode kernel takes float keys and values, so every layer's "
                "cache is dequantized to a full compute-dtype copy each decode step (more HBM "
                "traffic than a bf16 cache); a paged pool (rollout.kv_pages) is read by JAX's "
                "GPU paged kernel as codes")
    elif devices == "tpu" and paged and kv_scale == "token":
        what = ("JAX's TPU paged kernel wrapper broadcasts the per-token scales to the pages' "
                "shape (float32, as large as each layer's pool) every decode step; "
                "rollout.kv_scale='sequence' gives it plain 8-bit pages")
    else:
        return
    logging.getLogger(__name__).warning("8-bit KV cache on %s: %s.", devices.upper(), what)


class Engine:
    """Models, cache layout, buckets and sharding of one model configuration and `dot_general`.

    Args:
      config: the model configuration.
      dot_general: the model's matmul hook (`jax.lax.dot_general` for full-precision parameters, the
        quantized hook from `qurl_jax.quant` for quantized rollout parameters).
      max_prompt_len: longest prompt accepted (the largest prompt bucket).
      max_new_tokens: longest response accepted (the largest generation bucket).
      prompt_buckets / gen_buckets: explicit bucket lists; default powers of two from `min_bucket`
        up to the maximum. A dense cache holds prompt_bucket + gen_bucket slots.
      min_bucket: smallest power-of-two bucket.
      pad_id: token id written into prompt pads and after EOS (always masked out).
      mesh: optional device mesh; rows are sharded over ('data', 'fsdp'). Parameters must already
        be placed on the mesh.
      platform: the platform the programs are built for (default: the mesh's devices', or JAX's
        default backend without a mesh). Work that only pays on the CPU is done only when it is
        'cpu' (see `prepare`); on an accelerator the decode loop runs the plain model. Naming an
        accelerator here on a host mesh builds the accelerator's programs for the host (what a
        memory estimate wants).
      kv_policy: Sparse-RL's KV compression (`KVPolicyConfig`; default dense, no compression);
        see `_cache.CompressedKV`. The reported log-probs are those of the sparse forward that
        sampled each token.
      decode_attention: how a decode step's attention reads a dense cache (`decode_model`):
        'auto' = the ragged Pallas kernel on GPU devices (`models.decode_attention`: only each
        row's live slots are read), XLA's masked attention on TPU (and for a GPU's programs
        built on host devices), qurl_jax's CPU kernel on a single CPU device; 'xla' = XLA's
        dense masked attention on every platform (the reference);
        'pallas' = the ragged Pallas kernel (GPU; on CPU in Pallas' interpreter, for tests; TPU
        has no dense ragged kernel: an error). A compressed cache (`kv_policy`) has holes in its
        live slots, which the ragged kernel cannot express: it keeps the masked path. A paged
        cache (`paging`) reads its pages with JAX's paged kernel on GPU and TPU ('auto' and
        'pallas'; on CPU 'pallas' runs the GPU kernel in Pallas' interpreter) and with XLA's
        gather otherwise (`paged_hook`).
      paging: a paged KV pool (`_cache.Paging`; the refilling sampler's `kv_pages`) instead of
        a dense cache of prompt + generation slots per row.
      decode_chunk: decode steps per iteration of the samplers' decode loops (`decode_while`);
        0 = `GPU_DECODE_CHUNK` where the programs run on GPU devices, 1 elsewhere (a plain
        `lax.while_loop`, one step per iteration).
      command_buffer: the GPU decode programs' `xla_gpu_enable_command_buffer` (a comma list
        of XLA's command types; `compiler_options`); None = `GPU_COMMAND_BUFFER`, '' = XLA's
        default. Ignored on other platforms.
      fused_products: how a decode step runs its W8A8 products (`FUSED_PRODUCTS`): 'on' =
        one Pallas launch per product with its quantization and epilogue (`quant.FusedDecode`)
        where the programs run on GPU devices and the rollout mesh has no tensor axis, for
        every layer whose kernels the kernels take (per-channel int8 / fp8 stored transposed by
        `prepare`); 'off' = XLA's products (AQT's path, the model's own layer); 'auto' = the
        faster of the two as measured, today XLA's everywhere (one H200, 2026-11-29: the 1.5B
        int8 decode step at 64 rows took 4.22 ms with the fused kernels, 2.52 ms with XLA's;
        docs/performance.md); 'interpret' = the fused kernels in Pallas' interpreter wherever
        the programs run (tests).
      kv_precision: how every cache layout holds keys and values (`models.kv_quant`): 'bf16'
        (the compute dtype) or 'int8' / 'fp8' codes with a float32 scale per token and kv head,
        quantized once where written. JAX's paged kernels read 8-bit pages as they are (GPU:
        `k_scales_pages`; TPU: `QuantizedTensor`); every other reader (XLA's attention, the CPU
        and GPU dense kernels, Sparse-RL's scores) takes the values dequantized to the compute
        dtype. The reported log-probs are those of the 8-bit cache that sampled each token.
    """

    def __init__(
        self,
        config: ModelConfig,
        dot_general: DotGeneral = jax.lax.dot_general,
        *,
        max_prompt_len: int = 1024,
        max_new_tokens: int = 1024,
        prompt_buckets: Sequence[int] | None = None,
        gen_buckets: Sequence[int] | None = None,
        min_bucket: int = 16,
        pad_id: int = 0,
        mesh: Mesh | None = None,
        platform: str | None = None,
        kv_policy: KVPolicyConfig | None = None,
        decode_attention: str = "auto",
        paging: Paging | None = None,
        kv_precision: KVPrecision | str = KVPrecision.BF16,
        decode_chunk: int = 0,
        command_buffer: str | None = None,
        fused_products: str = "auto",
    ) -> None:
        if decode_attention not in DECODE_ATTENTION:
            raise ValueError(f"decode_attention={decode_attention!r} must be one of "
                             f"{DECODE_ATTENTION}")
        self.config = config.validate()
        self.kv_policy = KVPolicyConfig() if kv_policy is None else kv_policy.validate()
        self.model = Transformer(config, dot_general)
        # Prompts run with the residual stream pinned to the batch shards, as in the learner (left
        # free, the int8 prefill of the 1.5B paper config split its MLP products over the
        # contracting dimension, every token on every device). Decode is left free: a step has
        # one token per row.
        self.prompt_model = Transformer(config, dot_general,
                                        shard_activation=activation_pinner(mesh))
        self.prompt_buckets = check_buckets(
            "prompt_buckets", prompt_buckets if prompt_buckets is not None
            else power_of_two_buckets(min_bucket, max_prompt_len))
        self.gen_buckets = check_buckets(
            "gen_buckets", gen_buckets if gen_buckets is not None
            else power_of_two_buckets(min_bucket, max_new_tokens))
        if not 0 <= pad_id < config.vocab_size:
            raise ValueError(f"Sampler.pad_id={pad_id} is outside the vocabulary [0, "
                             f"{config.vocab_size})")
        self.pad_id = int(pad_id)
        self.mesh = mesh
        self.sharding = RowSharding(mesh)
        self.kv_precision = kv_quant.kv_precision(kv_precision)
        self.layout = cache_layout(self.config, self.kv_policy, self.sharding, paging,
                                   self.kv_precision)
        self.paging = paging
        devices = platform_of(mesh) if mesh is not None else None
        self.platform = platform or devices or jax.default_backend()
        # Where the programs run: the mesh's devices (host devices when `platform` names an
        # accelerator for an estimate), else `platform`.
        self._devices = ragged.kernel_platform(devices or self.platform)
        if decode_attention == "pallas" and self._devices not in ("gpu", "cpu") and (
                paging is None or self._devices != "tpu"):
            raise ValueError(f"decode_attention='pallas' has no dense ragged kernel on platform "
                             f"{self._devices!r} (GPU, or CPU in Pallas' interpreter); use "
                             f"'auto' or 'xla'")
        self.decode_attention = decode_attention
        if decode_chunk < 0:
            raise ValueError(f"decode_chunk={decode_chunk} must be >= 0 (0 = the platform's)")
        gpu = self._devices == "gpu"
        self.decode_chunk = 1 if self.kv_policy.compresses else (
            decode_chunk or (GPU_DECODE_CHUNK if gpu else 1))
        self.command_buffer = GPU_COMMAND_BUFFER if command_buffer is None else command_buffer
        if fused_products not in FUSED_PRODUCTS:
            raise ValueError(f"fused_products={fused_products!r} must be one of {FUSED_PRODUCTS}")
        self.fused_products = fused_products
        if self.kv_precision.quantizes and decode_attention != "xla" \
                and not self.kv_policy.compresses:
            _warn_float_copy(self._devices, paging is not None, self.config.kv_scale)
        self._preparers: dict[bool, Any] = {}

    # ------------------------------------------------------------------------------ shapes
    @property
    def max_prompt_len(self) -> int:
        return self.prompt_buckets[-1]

    @property
    def max_new_tokens(self) -> int:
        return self.gen_buckets[-1]

    def buckets(self, prompt_len: int, max_new_tokens: int) -> tuple[int, int]:
        """(prompt bucket, generation bucket) of these lengths."""
        return bucket(prompt_len, self.prompt_buckets), bucket(max_new_tokens, self.gen_buckets)

    def cache_slots(self, prompt_len: int, max_new_tokens: int) -> int:
        """Physical KV-cache slots per row for these lengths (after rounding up to buckets)."""
        return self.layout.slots(*self.buckets(prompt_len, max_new_tokens))

    def prefill_slots(self, p_len: int) -> int:
        """Cache slots a prompt bucket of p_len holds after prefill (a compressed policy keeps at
        most `budget`)."""
        return self.layout.prefill_slots(p_len)

    def kv_bytes_per_row(self, prompt_len: int, max_new_tokens: int) -> int:
        """Bytes of keys and values one rollout row's cache holds, all layers (`cache_slots`
        slots of num_kv_heads * head_dim elements at `kv_precision`, for K and for V, with an
        8-bit cache's float32 scales; the 4-byte position per slot is not counted)."""
        cfg = self.config
        per_slot = cfg.num_layers * self.kv_precision.bytes_per_token(
            cfg.num_kv_heads, cfg.head_dim, cfg.compute_dtype)
        return self.cache_slots(prompt_len, max_new_tokens) * per_slot

    def check(self, prompts: Sequence[Sequence[int]], n: int, settings: SamplingParams
              ) -> SamplingParams:
        """Raises ValueError naming the bad argument or field; returns `settings`."""
        if not isinstance(settings, SamplingParams):
            raise ValueError(f"settings={settings!r} must be a SamplingParams")
        check_prompts(prompts, n, self.config.vocab_size, self.max_prompt_len)
        return settings.check(self.config.vocab_size, self.max_new_tokens)

    def compiler_options(self) -> dict[str, Any]:
        """XLA options of the decode programs (`jax.jit(..., compiler_options=...)`): on GPU
        devices the command types recorded into CUDA graphs (`command_buffer`); none
        elsewhere, so the other platforms' programs are XLA's defaults."""
        if self._devices != "gpu" or not self.command_buffer:
            return {}
        # A captured loop is one command of its caller: XLA's smallest graph (5 commands) would
        # leave a program of a few top-level thunks, the loop among them, without any graph.
        return {"xla_gpu_enable_command_buffer": self.command_buffer,
                "xla_gpu_graph_min_graph_size": 1}

    def decode_while(self, cond: Callable, step: Callable, carry: tuple,
                     limit: jax.Array | None = None) -> tuple:
        """`lax.while_loop(cond, step, carry)` over a decode loop's carry (i, DecodeState),
        `step` one decode step that counts i. With `decode_chunk` K > 1 (GPU) each iteration
        runs K steps in a loop of known trip count, `cond` checked between chunks: XLA's GPU
        runtime reads a while loop's predicate on the host every iteration unless its trip
        count is known, so a chunk makes one host round trip per K steps. Inside a chunk the
        steps run on after `cond` turns false: rows still live keep decoding (the refilling
        sampler then returns up to K - 1 steps after its stop condition; the rows' tokens are
        the same) and finished rows do nothing, except past `limit` (i >= limit), where a step
        runs with no row live (nothing recorded, no cache moved, i not counted). K = 1 is the
        plain loop."""
        chunk = self.decode_chunk
        if chunk == 1:
            return jax.lax.while_loop(cond, step, carry)

        def one(_: int, carry: tuple) -> tuple:
            if limit is None:
                return step(carry)
            i, s = carry
            go = i < limit
            i_next, s_next = step((i, s.replace(live=s.live & go)))
            return jnp.where(go, i_next, i), s_next.replace(live=jnp.where(go, s_next.live,
                                                                           s.live))

        return jax.lax.while_loop(cond, lambda c: jax.lax.fori_loop(0, chunk, one, c), carry)

    # ------------------------------------------------------------------------------ programs
    def preparer(self, rows: int) -> Any:
        """`prepare` for a decode loop of `rows` rows, jitted: one program per packing choice
        (`quant.packs_for_decode`), so the loops of a run that pack alike share it."""
        pack = packs_for_decode(rows)
        if pack not in self._preparers:
            self._preparers[pack] = jax.jit(functools.partial(self.prepare, pack=pack))
        return self._preparers[pack]

    def prefill(self, params: Params, tokens: jax.Array, mask: jax.Array
                ) -> tuple[jax.Array, Cache]:
        """The P prompts' forward (tokens i32[P, p_len], mask bool[P, p_len]): last-position
        logits f32[P, V] and their cache (`prefill_slots(p_len)` slots), rows over the batch
        shards."""
        logits, cache = self.layout.prefill(self.prompt_model, params, tokens, mask)
        return self.sharding.rows(logits), self.layout.constrain(cache)

    def prepare(self, params: Params, pack: bool = True) -> Params:
        """The decode loop's parameters: loop-invariant work on `params`, done once per `sample`
        call by both samplers, in a program of its own (the decode programs take its output;
        `preparer`).

        Float parameters are cast to the compute dtype here rather than by the model every step.
        On GPU devices the 8-bit linear kernels are stored transposed, in the layout the GPU's
        8-bit products read (`quant.transpose_for_gpu`), so no decode program copies them; with
        `fused_products='interpret'` on any platform too, the layout the fused kernels read.

        CPU-only work, done only when the `platform` is 'cpu' (the one predicate; on an
        accelerator each of these would cost memory or time for nothing):
        - A tied LM head multiplies by the embedding transposed ([V, E] contracted on E); XLA's
          CPU matmuls read such a transposed operand far slower than a [E, V] kernel (the LM head
          is the largest matrix of a small model), so the loop runs the same model untied, with
          the head kernel materialised once as embedding.T (a second copy of the embedding) under
          `lm_head`. The optimization barrier keeps XLA from folding the transpose back into the
          product.
        - On a single device, int8 kernels are stored once in qurl_jax's int8 matmul kernel's
          packed layout (`quant.pack_for_decode`, a packed copy of those weights) where this
          machine can run it and `pack` (`quant.packs_for_decode(rows)`: not on an AMX CPU for a
          loop of more rows than the kernel takes, where XLA's GEMM is faster).
        - An int8 LM head (`rollout.quantize_vocab`) holds its codes in the compute dtype
          (`QuantizedTensor.codes_as`: the same values): XLA:CPU casts int8 codes outside the
          product, i.e. the whole head every step (about 5x the float head's time, [768, 32000]).
          So do the decoder layers' weight-only kernels (a LoRA run's frozen base as its
          evaluation reads it, `lora.weight_only`).
        """
        cfg = self.config
        params = cast_floats(params, cfg.compute_dtype)
        if self._devices == "gpu" or self.fused_products == "interpret":
            return transpose_for_gpu(params)
        if self.platform != "cpu":
            return params
        if self.sharding.single_device and pack:
            params = pack_for_decode(params)
        is_q = lambda x: isinstance(x, QuantizedTensor)  # noqa: E731
        widen = lambda x: x.codes_as(cfg.compute_dtype) if is_q(x) and (  # noqa: E731
            x.act_format is None and not x.packed and jnp.issubdtype(x.qvalue.dtype, jnp.integer)
        ) else x
        params = {k: jax.tree.map(widen, v, is_leaf=is_q) if k.startswith("layers_") else v
                  for k, v in params.items()}
        embedding = params["embed_tokens"]["embedding"]
        if not cfg.tie_word_embeddings:
            head = params["lm_head"]["kernel"]
            if isinstance(head, QuantizedTensor) and head.act_format is None:
                params = {**params, "lm_head": {"kernel": head.codes_as(cfg.compute_dtype)}}
            return params
        barrier = jax.lax.optimization_barrier
        if isinstance(embedding, QuantizedTensor):  # [V, E], a scale per entry -> [E, V]
            head = embedding.replace(qvalue=embedding.qvalue.T, scale=embedding.scale.T,
                                     block=embedding.block[::-1]).codes_as(cfg.compute_dtype)
            head = head.replace(
                qvalue=self.sharding.constrain(barrier(head.qvalue), ("embed", "vocab")),
                scale=self.sharding.constrain(head.scale, ("embed", "vocab")))
        else:
            head = self.sharding.constrain(barrier(jnp.transpose(embedding)), ("embed", "vocab"))
        return {**params, "lm_head": {"kernel": head}}

    def decode_model(self, prepared: Params) -> Transformer:
        """The model that runs `prepare`'s output: untied when it carries the head kernel, with
        the decode attention hook `attention_hook` chooses and the fused products
        `fused_hook` chooses."""
        cfg = self.config
        hook, paged, fused = self.attention_hook(), self.paged_hook(), self.fused_hook()
        if self.platform == "cpu" and cfg.tie_word_embeddings and "lm_head" in prepared:
            cfg = cfg.replace(tie_word_embeddings=False)
        elif hook is None and paged is None and fused is None:
            return self.model
        return Transformer(cfg, self.model.dot_general, hook, paged, fused_decode=fused)

    def fused_hook(self) -> FusedDecode | None:
        """The decode model's fused W8A8 products (`fused_products`; None: XLA's): on GPU
        devices ('on') or in Pallas' interpreter ('interpret'), per batch shard on a mesh, not
        where the rollout mesh splits the weights over a tensor axis. Which layers it runs is
        its own `applies` (per-channel 8-bit kernels stored transposed, as `prepare` stores
        them on GPU devices and with 'interpret')."""
        mesh, choice = self.mesh, self.fused_products
        if choice in ("off", "auto") or (choice == "on" and self._devices != "gpu") or (
                mesh is not None and dict(mesh.shape).get("tensor", 1) > 1):
            return None
        P = jax.sharding.PartitionSpec

        def rows(shape: tuple[int, ...]) -> jax.sharding.PartitionSpec:
            return logical_to_mesh_spec(P("batch", *(None,) * (len(shape) - 1)), shape, mesh)

        return FusedDecode(interpret=choice == "interpret", mesh=mesh,
                           row_spec=rows if mesh is not None else None)

    @property
    def paged_gathers(self) -> bool:
        """A paged step gathers every page its page table names (XLA, the CPU kernel) rather
        than reading each row's live pages (JAX's paged kernels on GPU and TPU): the host then
        hands it a table only as wide as the pages held."""
        return self.paging is not None and (self.paged_hook() is None or self._devices == "cpu")

    def paged_hook(self) -> PagedAttention | None:
        """The decode model's paged attention (None: the model's XLA gather, or no pages): JAX's
        paged Pallas kernel where the programs run on GPU or TPU devices ('auto', 'pallas'), in
        Pallas' interpreter on host devices with 'pallas' (tests); with 'auto' on one CPU
        device, the gathered pages through the CPU decode-attention kernel. On a mesh it runs
        per shard: each batch shard's rows read their own block of the pool (`_cache.PagedKV`)."""
        if self.paging is None or self.decode_attention == "xla" or self._exact:
            return None
        devices, cfg = self._devices, self.config
        if self.decode_attention == "auto" and self.platform == "cpu":
            if self.sharding.single_device and cpu_attention.usable(cfg.compute_dtype,
                                                                    cfg.head_dim):
                # The pages gathered, then the CPU kernel (it reads up to the longest row).
                return functools.partial(ragged.paged_decode_attention, impl="cpu",
                                         platform="cpu")
            return None
        if self.decode_attention == "auto" and (
                devices not in ("gpu", "tpu") or ragged.kernel_platform(self.platform) != devices):
            return None
        kernel = functools.partial(ragged.paged_decode_attention, impl="pallas",
                                   platform=devices, interpret=devices == "cpu",
                                   row_scales=cfg.kv_scale == "sequence")
        # GPU: one scatter per pool writes every kv head (`put_all_heads`); elsewhere one per
        # head, the layout TPU's kernel reads (`put_tokens`).
        put = put_all_heads if devices == "gpu" else put_tokens
        mesh = self.mesh
        if mesh is None or mesh.size == 1:
            return _PerShardPaged(kernel, put, ragged.row_scale) if put is not put_tokens \
                else kernel
        P = jax.sharding.PartitionSpec

        shards = self.sharding.batch_shards

        def sharded(q, k_pages, v_pages, page_table, lengths, k_scales=None, v_scales=None):
            rows = logical_to_mesh_spec(P("batch", "heads"), q.shape[:2], mesh)
            pool = logical_to_mesh_spec(P("kv_heads", "batch"), k_pages.shape[:2], mesh)
            table = P(rows[0], None)
            per_shard = k_pages.shape[1] // shards
            scales = () if k_scales is None else (k_scales, v_scales)

            def local(q, k, v, t, n, *scales):  # the shard's page ids are a block of `per_shard`
                kw = dict(zip(("k_scales", "v_scales"), scales, strict=True)) if scales else {}
                return kernel(q, k, v, t % per_shard, n, **kw)

            run = jax.shard_map(local, mesh=mesh,
                                in_specs=(rows, pool, pool, table, P(rows[0])) + (pool,) * len(
                                    scales), out_specs=rows, check_vma=False)
            return run(q, k_pages, v_pages, page_table, lengths, *scales)

        def write(pool, page, offset, new):
            # Each shard's rows write into its own block of pages: a global scatter would
            # all-gather every row's new keys and values to every device, every layer and token.
            rows = logical_to_mesh_spec(P("batch", "kv_heads"), new.shape[:2], mesh)
            spec = logical_to_mesh_spec(P("kv_heads", "batch"), pool.shape[:2], mesh)
            total = pool.shape[1]
            per_shard = total // shards

            def local(pool, page, offset, new):
                mine = jnp.where(page < total, page % per_shard, per_shard)  # else dropped
                return put(pool, mine, offset, new)

            return jax.shard_map(local, mesh=mesh, in_specs=(spec, P(rows[0]), P(rows[0]), rows),
                                 out_specs=spec, check_vma=False)(pool, page, offset, new)

        def row_scale(scales, page_table):
            # Each shard's rows read their first page in their own block of the pool: a global
            # gather would all-gather the page table and all-reduce the scales, every layer
            # and token.
            spec = logical_to_mesh_spec(P("kv_heads", "batch"), scales.shape[:2], mesh)
            rows = logical_to_mesh_spec(P("batch", "kv_heads"),
                                        (page_table.shape[0], scales.shape[0]), mesh)
            per_shard = scales.shape[1] // shards
            return jax.shard_map(lambda s, t: ragged.row_scale(s, t % per_shard), mesh=mesh,
                                 in_specs=(spec, P(rows[0], None)), out_specs=rows,
                                 check_vma=False)(scales, page_table)

        return _PerShardPaged(sharded, write, row_scale)

    def attention_hook(self) -> DecodeAttention | None:
        """The decode model's attention hook (None: XLA's masked attention over every slot), by
        `decode_attention` (see the class docstring), the platform and the cache layout.

        The ragged Pallas kernel reads each row's window [first live slot, last live slot] off
        the key mask (`ragged.model_hook`), exact for a dense cache, whose live slots are
        contiguous; a compressed cache keeps the masked path (the CPU kernel takes the mask
        itself, so it serves both). 'auto' takes the GPU kernel only where the programs run on
        GPU devices (an accelerator's programs built on host devices for an estimate keep XLA);
        'pallas' on host devices runs it in Pallas' interpreter. On a mesh the kernel runs per
        shard (`_per_shard`)."""
        cfg = self.config
        choice, devices = self.decode_attention, self._devices
        if choice == "xla" or self.paging is not None or self._exact:  # paged: `paged_hook`
            return None
        if choice == "auto" and self.platform == "cpu":
            if self.sharding.single_device and cpu_attention.usable(cfg.compute_dtype,
                                                                    cfg.head_dim):
                return cpu_attention.decode_attention
            return None
        if self.layout.compresses or (choice == "auto" and (
                ragged.kernel_platform(self.platform) != "gpu" or devices != "gpu")):
            return None
        # 'auto' on GPU falls back to XLA per call when the slots have no kernel tiling.
        hook = ragged.model_hook("pallas" if choice == "pallas" else "auto", platform=devices,
                                 interpret=devices == "cpu")
        return self._per_shard(hook)

    def _per_shard(self, hook: DecodeAttention) -> DecodeAttention:
        """`hook` under `jax.shard_map` over the mesh (identity without one): XLA does not
        partition a Pallas call, so each device runs the kernel on its own rows (batch shards)
        and kv heads ('tensor'). JAX's kernels declare no varying axes: check_vma=False."""
        mesh = self.mesh
        if mesh is None or mesh.size == 1:
            return hook

        def sharded(q, keys, values, key_mask, length):
            rows = logical_to_mesh_spec(jax.sharding.PartitionSpec("batch", "kv_heads"),
                                        q.shape[:2], mesh)
            mask = jax.sharding.PartitionSpec(rows[0], None)
            del length  # the window is read off the key mask
            run = jax.shard_map(lambda q, k, v, m: hook(q, k, v, m, None), mesh=mesh,
                                in_specs=(rows, rows, rows, mask), out_specs=rows,
                                check_vma=False)
            return run(q, keys, values, key_mask)

        return sharded

    def empty_state(self, slots: int, rows: int, cache: Cache, g_len: int) -> DecodeState:
        """Every slot idle (row N: out of range) over `cache`, outputs of N = rows empty."""
        i32 = jnp.int32
        return DecodeState(
            cache=cache, tok=jnp.full((slots,), self.pad_id, i32), step=jnp.zeros((slots,), i32),
            live=jnp.zeros((slots,), jnp.bool_), row=jnp.full((slots,), rows, i32),
            stream=jnp.zeros((slots,), i32), limit=jnp.ones((slots,), i32),
            tokens=jnp.full((rows, g_len), self.pad_id, i32),
            logp=jnp.zeros((rows, g_len), jnp.float32),
            logp_untruncated=jnp.zeros((rows, g_len), jnp.float32),
            mask=jnp.zeros((rows, g_len), jnp.bool_))

    def admit(self, state: DecodeState, slots: jax.Array, rows: jax.Array, streams: jax.Array,
              limits: jax.Array, logits: jax.Array, decoding: Decoding, mode: SamplingMode
              ) -> DecodeState:
        """Admits K rows: row rows[i] (random stream streams[i], length limit limits[i]) goes to
        slot slots[i] with its first token sampled from logits f32[K, V] (its prompt's last
        position; column 0 of its stream). Entries with slot R / row N are dropped. The slots'
        cache rows are the caller's (`CacheLayout.admit`)."""
        tok, lp, lp_full = self._sample(logits, decoding, streams, jnp.zeros_like(streams), mode)
        state = _record(state, rows, jnp.zeros_like(rows), tok, lp, lp_full)
        ended = decoding.is_eos(tok) | (limits <= 1)

        # The six per-slot fields in one scatter: the TPU compiler fuses scatters that share
        # their indices into one multi-output scatter and then fails a check on it
        # (libtpu 0.0.42.1, scatter_emitter.cc: "operand_indices.size() == 1").
        i32 = jnp.int32
        fields = (state.tok, state.step, state.live, state.row, state.stream, state.limit)
        new = (tok, jnp.ones_like(rows), ~ended, rows, streams, limits)
        table = jnp.stack([f.astype(i32) for f in fields], axis=1)
        table = table.at[slots].set(jnp.stack([x.astype(i32) for x in new], axis=1), mode="drop")
        tok_, step, live, row, stream, limit = (table[:, i].astype(f.dtype)
                                                for i, f in enumerate(fields))
        return state.replace(tok=tok_, step=step, live=live, row=row, stream=stream, limit=limit)

    def step(self, model: Transformer, params: Params, state: DecodeState, decoding: Decoding,
             mode: SamplingMode, *, observe: bool = False, compress: bool = False
             ) -> DecodeState:
        """One decode step of every slot: each live slot's last token through `model` (with
        `prepare`d params), its next token sampled (column `step` of its stream), recorded in
        its output row, and the slot finished on an EOS id or at its length limit.

        A slot that is not live still runs through the model (the batch has a static shape), but
        its token is masked as an empty cache slot and its cache does not move, so its cache
        stays within its S slots and nothing it computes is recorded. `observe` has a compressed
        layout record the step's queries; `compress` then compresses the live rows due at their
        own step (the refilling sampler, whose rows are at different steps; the static sampler
        compresses its aligned rows once per interval instead)."""
        live = state.live
        logits, cache = self.layout.forward(model, params, state.tok, state.cache, live, observe)
        if compress:
            cache = self.layout.compress(cache, self.layout.due(cache, state.step) & live)
        tok, lp, lp_full = self._sample(logits, decoding, state.stream, state.step, mode)
        state = _record(state, jnp.where(live, state.row, state.rows), state.step, tok, lp,
                        lp_full)
        step = state.step + live.astype(jnp.int32)
        ended = decoding.is_eos(tok) | (step >= state.limit)
        return state.replace(cache=cache, tok=jnp.where(live, tok, state.tok), step=step,
                             live=live & ~ended)

    def _sample(self, logits: jax.Array, decoding: Decoding, streams: jax.Array,
                steps: jax.Array, mode: SamplingMode
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """(token, log-prob, untruncated log-prob) per row of logits f32[R, V], row r drawing
        column steps[r] of stream streams[r]."""
        row_keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(decoding.key, streams)
        step_keys = jax.vmap(jax.random.fold_in)(row_keys, steps)
        tok, lp, lp_full = sample_tokens(logits, step_keys, decoding.temperature, decoding.top_p,
                                         mode)
        if self._exact:
            # The learner's log-prob in the learner's order (a truncated draw keeps its own lp).
            lp_full = exact_lib.token_logprobs(logits, tok, decoding.temperature, token_logprobs)
            lp = lp if mode.truncates else lp_full
        return tok, lp, lp_full

    @property
    def _exact(self) -> bool:
        """Exact on-policy numerics (`ModelConfig.numerics`): the model's own fixed-order
        attention instead of the decode hooks, and the learner's log-prob."""
        return self.config.numerics == "exact"

    def finish(self, state: DecodeState, eos_ids: jax.Array) -> dict[str, jax.Array]:
        """The outputs' `SampleOutput.PER_ROW` fields (N rows, G columns)."""
        lengths, finish = finish_reasons(state.tokens, state.mask, eos_ids)
        return dict(tokens=state.tokens, logp=state.logp, logp_untruncated=state.logp_untruncated,
                    mask=state.mask, lengths=lengths, finish_reason=finish)

    def take(self, state: DecodeState, index: jax.Array) -> DecodeState:
        """The state of slots `index` (i32[R']) in that order; the outputs as they are."""
        take = lambda x: jnp.take(x, index, axis=0)  # noqa: E731
        return state.replace(cache=self.layout.take(state.cache, index), tok=take(state.tok),
                             step=take(state.step), live=take(state.live), row=take(state.row),
                             stream=take(state.stream), limit=take(state.limit))

    def constrain(self, state: DecodeState) -> DecodeState:
        """Slots and output rows over the batch shards."""
        if self.mesh is None:
            return state
        c = self.sharding.constrain
        return DecodeState(
            cache=self.layout.constrain(state.cache), tok=c(state.tok, ROW_AXES),
            step=c(state.step, ROW_AXES), live=c(state.live, ROW_AXES),
            row=c(state.row, ROW_AXES), stream=c(state.stream, ROW_AXES),
            limit=c(state.limit, ROW_AXES),
            tokens=c(state.tokens, _OUT_AXES), logp=c(state.logp, _OUT_AXES),
            logp_untruncated=c(state.logp_untruncated, _OUT_AXES), mask=c(state.mask, _OUT_AXES))


def put_all_heads(pool: jax.Array, page: jax.Array, offset: jax.Array, new: jax.Array
                  ) -> jax.Array:
    """`models.transformer.put_tokens`'s contract (pool f[Hkv, P, page_size, D] or a scale pool
    f32[Hkv, P, page_size]; new f[B, Hkv, 1, D] or f32[B, Hkv, 1]; rows whose page is P or more
    dropped) in one scatter of every kv head's window: the same values, one kernel where
    `put_tokens` launches one per head (each a kernel of the GPU's decode step). On GPU the
    pool keeps its row-major layout with it (`bench.explain`: no copy of a pool)."""
    return pool.at[:, page, offset].set(jnp.moveaxis(new[:, :, 0], 0, 1).astype(pool.dtype),
                                        mode="drop")


def _record(state: DecodeState, rows: jax.Array, cols: jax.Array, tok: jax.Array,
            lp: jax.Array, lp_full: jax.Array) -> DecodeState:
    """Writes one token per entry at (rows, cols) of the outputs; entries with row N are
    dropped."""
    def put(buf: jax.Array, x: jax.Array) -> jax.Array:
        return buf.at[rows, cols].set(x.astype(buf.dtype), mode="drop")

    return state.replace(tokens=put(state.tokens, tok), logp=put(state.logp, lp),
                         logp_untruncated=put(state.logp_untruncated, lp_full),
                         mask=put(state.mask, jnp.ones_like(tok, jnp.bool_)))
