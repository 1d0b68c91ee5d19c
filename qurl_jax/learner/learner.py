"""The learner: log-prob recomputation and the policy update, jitted and sharded.

Both functions are compiled once with explicit `NamedSharding`s over the mesh
`(data, fsdp, tensor)`: parameters and optimizer state follow the logical-axis rules of
`qurl_jax.parallel.sharding`, batch arrays are split over `data x fsdp` on their leading axis.
Parameters and optimizer state are donated to the update, so the step runs in place.

Sequences are laid out as `[prompt (left-padded to P) | response (G slots)]`; the log-prob of
response token t comes from the logits at position P - 1 + t. The policy being optimised is the
tempered one the sampler drew from (logits / temperature), so behaviour, proximal and current
log-probs are all on the same distribution.

The update accumulates gradients over `num_micro_batches` slices of the batch with `lax.scan`
(each micro-batch weighted by its loss normaliser, so the result is the whole batch's loss and
gradient), clips the global norm, and applies AdamW. Memory is bounded by a few knobs (see
`Learner`): micro-batches, per-layer rematerialisation, response-only log-probs computed in chunks
of positions, and the model's attention implementation (blockwise above a length threshold);
`qurl_jax.plan.memory_plan` (`python -m qurl_jax.bench.memory`) compiles both programs for a config
and reports their memory. The training precision (`Learner(precision=...)`, `train.precision`) is
bound inside both programs, per (micro-)batch: 'fp' runs float matmuls; 'fp8_block' runs every
linear layer of the recipe in block-scaled FP8 in the forward and backward
(`quant.bind_train_precision`), the same quantization the sampler's 'fp8_block' rollout applies, so
pi_prox and pi_behav come from the same quantized policy (Jet-RL). It composes with remat, the layer
scan, micro-batches and the mesh. A non-finite loss or gradient leaves parameters and optimizer
state unchanged and is reported in
the metrics (`update/skipped`), so the trainer can count bad steps without losing the last good
state.

Packing (`Learner(packing=True)`, `train.packing`): `logprobs` and `update` take the same padded
batch, but pack its sequences (`qurl_jax.learner.packing`, host-side, each process its own rows)
into rows of `pack_length` tokens per micro-batch slice before the jitted program runs: the programs
then compute only real tokens plus at most a bucket's worth of empty rows, and `resp_index` gathers
the response log-probs back to [B, G], so the objective sees exactly what the padded layout gives
it.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from qurl_jax import lora as lora_lib
from qurl_jax import quant
from qurl_jax.learner import packing as packing_lib
from qurl_jax.models import (
    ModelConfig,
    Remat,
    Transformer,
    chunked_token_logprobs,
    cpu_weight_grads,
    lm_head_logits,
    param_logical_axes,
)
from qurl_jax.models.attention import PackedSegments
from qurl_jax.parallel import distributed as dist
from qurl_jax.parallel import sharding as shd
from qurl_jax.parallel.targets import platform_of
from qurl_jax.rl.objectives import (
    Mode,
    ObjectiveConfig,
    loss_weight,
    policy_loss,
    sparse_rl_rejections,
)
from qurl_jax.runtime import xla_cpu

Batch = dict[str, jax.Array]

# Keys of a learner batch; all have the global batch as leading axis.
#   tokens i32[B, P+G], positions i32[B, P+G], attn_mask bool[B, P+G] (real tokens),
#   resp_mask f32[B, G] (tokens in the loss), logp_behav / logp_prox / logp_ref f32[B, G],
#   advantages f32[B], prox_from_forward bool[B]. An update batch without logp_prox takes pi_prox
#   from the update's own forward with the gradient stopped, and so do the rows whose
#   prox_from_forward is set: right only when the parameters are pi_prox's
#   (`qurl_jax.learner.prox.prox_source`).
_BATCH_SPECS = {  # key: (width after the batch axis: P + G, G or none; dtype)
    "tokens": ("P+G", jnp.int32), "positions": ("P+G", jnp.int32),
    "attn_mask": ("P+G", jnp.bool_), "resp_mask": ("G", jnp.float32),
    "logp_behav": ("G", jnp.float32), "logp_prox": ("G", jnp.float32),
    "logp_ref": ("G", jnp.float32), "advantages": ("", jnp.float32),
    "prox_from_forward": ("", jnp.bool_)}
BATCH_KEYS = tuple(_BATCH_SPECS)


def batch_spec(key: str, rows: int, prompt_len: int, response_len: int
               ) -> tuple[tuple[int, ...], Any]:
    """(shape, dtype) of the learner batch's array `key` (`BATCH_KEYS`) for `rows` sequences of
    `prompt_len` + `response_len` slots: what the memory plan and the FLOP count compile."""
    width, dtype = _BATCH_SPECS[key]
    tail = {"P+G": (prompt_len + response_len,), "G": (response_len,), "": ()}[width]
    return (rows, *tail), dtype


def _head_dot(precision: str | quant.Recipe) -> Callable:
    """The LM head's product: the training precision's, whose float path (`fp`) also reads a
    frozen LoRA base's int8 vocabulary table weight-only (`quant.rollout_dot_general`: a plain
    array goes to `lax.dot_general` unchanged)."""
    dot = quant.make_train_dot_general(precision)
    return quant.rollout_dot_general if dot is jax.lax.dot_general else dot


def response_logprobs(model: Transformer, params: Any, tokens: jax.Array, positions: jax.Array,
                      attn_mask: jax.Array, response_len: int, temperature: float, *,
                      chunk: int, with_entropy: bool = False,
                      precision: str | quant.Recipe = "fp"
                      ) -> tuple[jax.Array, jax.Array | None]:
    """f32[B, G] log-probs of the response tokens (and f32[B, G] entropies if asked).

    Only the G positions that predict response tokens reach the LM head, in chunks of `chunk`
    positions (`chunked_token_logprobs`): the f32 [B, G, V] logits never exist whole.
    `precision` is the training precision (`quant.bind_train_precision`): with `fp8_block` every
    linear layer the recipe quantizes runs its forward and backward products in block-scaled FP8,
    quantizing the same float32 values the sampler's `requantize` does; padding tokens stay out
    of every scale.
    """
    model, params = quant.bind_train_precision(model, params, precision, token_mask=attn_mask)
    hidden, _ = model.apply({"params": params}, tokens, positions, attn_mask, return_hidden=True)
    hidden = hidden[:, -response_len - 1:-1]  # [B, G, E]: position P - 1 + t predicts token t
    # The head runs on chunks of response positions, so it gets the unmasked hook: the same
    # product for an unquantized head (a plain array), FP8 only if the recipe quantizes it.
    head_dot = _head_dot(precision)
    head = lambda h: lm_head_logits(model.config, params, h, head_dot)  # noqa: E731
    return chunked_token_logprobs(head, hidden, tokens[:, -response_len:], temperature,
                                  chunk=chunk, with_entropy=with_entropy,
                                  exact=model.config.numerics == "exact")


def packed_response_logprobs(model: Transformer, params: Any, rows: Batch,
                             resp_index: jax.Array, temperature: float, *, chunk: int,
                             with_entropy: bool = False, precision: str | quant.Recipe = "fp",
                             resp_target: jax.Array | None = None
                             ) -> tuple[jax.Array, jax.Array | None]:
    """`response_logprobs` of packed rows: f32[B, G] (and entropies) of the sequences whose
    response slots `resp_index` i32[B, G] points into rows {tokens, positions, segment_ids,
    attn_mask} [R, L] (`qurl_jax.learner.packing`).

    The LM head runs on every packed position (in chunks), each predicting the next token of its
    row, and a response token's log-prob is then read at the position before it; or, when the
    response slots (B x G) are fewer than the packed positions, on the hidden states of those
    slots gathered first. Padding slots read position 0 (a value no loss uses, as in the padded
    layout). FP8 scales see only real tokens.

    Rows whose responses share their prompt (`packing.pack_budget` with `group`: rows also hold
    `prefix_ids`) give `resp_target` i32[B, G], the token of every response slot: a response's
    first token is predicted at its prompt's last position, whose next token in the row is
    another response's. The head then runs on the slots' hidden states (float products only).
    """
    hidden, head = _packed_hidden(model, params, rows, precision)
    exact = model.config.numerics == "exact"
    tokens = rows["tokens"]
    if resp_target is not None:
        if quant.get_recipe(precision).quantizes:
            raise ValueError("shared prompts (train.share_prompts) need train.precision='fp'")
        hidden = hidden.reshape(-1, hidden.shape[-1])[resp_index]  # [B, G, E]
        return chunked_token_logprobs(head, hidden, resp_target, temperature, chunk=chunk,
                                      with_entropy=with_entropy)
    targets = _next_tokens(tokens)
    if resp_index.size < targets.size and not quant.get_recipe(precision).quantizes:
        # Fewer response slots than packed positions (short responses after long prompts): the
        # head runs on the slots' hidden states only, gathered first, instead of on every
        # packed position (the prompts' predictions are never read). Same products per slot;
        # FP8 keeps every position, whose scales a gather would change.
        hidden = hidden.reshape(-1, hidden.shape[-1])[resp_index]  # [B, G, E]
        return chunked_token_logprobs(head, hidden, targets.reshape(-1)[resp_index],
                                      temperature, chunk=chunk, with_entropy=with_entropy,
                                      exact=exact)
    logp, entropy = chunked_token_logprobs(head, hidden, targets, temperature, chunk=chunk,
                                           with_entropy=with_entropy, exact=exact)
    take = lambda x: x.reshape(-1)[resp_index]  # noqa: E731
    return take(logp), None if entropy is None else take(entropy)


def _next_tokens(tokens: jax.Array) -> jax.Array:
    """Each packed position's next token in its row (0 after the last)."""
    return jnp.concatenate([tokens[:, 1:], jnp.zeros_like(tokens[:, :1])], axis=1)


def _packed_hidden(model: Transformer, params: Any, rows: Batch, precision: str | quant.Recipe
                   ) -> tuple[jax.Array, Callable[[jax.Array], jax.Array]]:
    """The last hidden states of packed rows and the LM head that reads them (FP8 scales of the
    real tokens only)."""
    mask = rows["attn_mask"]
    model, params = quant.bind_train_precision(model, params, precision, token_mask=mask)
    segments = rows["segment_ids"]
    if "prefix_ids" in rows:
        segments = PackedSegments(segments, rows["prefix_ids"])
    hidden, _ = model.apply({"params": params}, rows["tokens"], rows["positions"], mask,
                            return_hidden=True, segment_ids=segments)
    head_dot = _head_dot(precision)
    return hidden, lambda h: lm_head_logits(model.config, params, h, head_dot)


def packed_token_logprobs(model: Transformer, params: Any, rows: Batch, temperature: float, *,
                          chunk: int, precision: str | quant.Recipe = "fp") -> jax.Array:
    """f32[R, L]: every packed position's log-prob of the next token in its row (the last
    position's of token 0), the LM head in chunks over every position. What
    `packed_response_logprobs` reads its slots from, before any gather: a token-budget log-prob
    pass gathers all its micro-batches' at once (`packing.TOKEN_KEYS`)."""
    hidden, head = _packed_hidden(model, params, rows, precision)
    logp, _ = chunked_token_logprobs(head, hidden, _next_tokens(rows["tokens"]), temperature,
                                     chunk=chunk, exact=model.config.numerics == "exact")
    return logp


def split_rows(batch: Batch, n: int) -> Batch:
    """[B, ...] -> [n, B / n, ...] with slice i = rows i, i + n, i + 2n, ...

    Strided rather than contiguous: the batch axis is sharded over devices in contiguous blocks, so
    every slice keeps B / n rows spread over all devices and the scan over slices needs no
    communication (a contiguous slice would live on one device). Each array is split by its own
    leading size (a packed batch's rows and sequences differ)."""
    for x in jax.tree.leaves(batch):
        if x.shape[0] % n:
            raise ValueError(f"batch size {x.shape[0]} is not divisible into {n} micro-batches")
    return jax.tree.map(lambda x: x.reshape(x.shape[0] // n, n, *x.shape[1:]).swapaxes(0, 1),
                        batch)


def merge_rows(x: jax.Array) -> jax.Array:
    """[n, B / n, ...] -> [B, ...], the inverse of `split_rows`."""
    return x.swapaxes(0, 1).reshape(-1, *x.shape[2:])


# How a metric of `policy_loss` combines over micro-batches: counts (and Sparse-RL's `sparse/*`
# counts) add up, extremes are extremes, a share of the valid tokens or sequences is weighted by
# that count (a micro-batch whose sequences were all vetoed keeps none, so a loss-weighted mean
# would not count its vetoes), everything else is a mean weighted like the loss
# (`objectives.loss_weight`).
_COUNT_METRICS = ("kept_tokens", "kept_sequences", "valid_tokens", "valid_sequences")
_VALID_SHARES = {"vetoed_seq_frac": "valid_sequences", "truncated_frac": "valid_tokens",
                 "masked_token_frac": "valid_tokens"}


def _metric_reduction(name: str) -> str:
    if name in _COUNT_METRICS or name.startswith("sparse/"):
        return "sum"
    if name in _VALID_SHARES:
        return "share"
    if name.endswith("_max"):
        return "max"
    if name.endswith("_min"):
        return "min"
    return "mean"


def _metric_identity(name: str) -> float:
    return {"max": -jnp.inf, "min": jnp.inf}.get(_metric_reduction(name), 0.0)


def _accumulate_metrics(acc: dict[str, jax.Array], new: dict[str, jax.Array],
                        weight: jax.Array) -> dict[str, jax.Array]:
    out = {}
    for k, v in new.items():
        how = _metric_reduction(k)
        if how == "max":
            out[k] = jnp.maximum(acc[k], v)
        elif how == "min":
            out[k] = jnp.minimum(acc[k], v)
        elif how == "sum":
            out[k] = acc[k] + v
        elif how == "share":
            out[k] = acc[k] + new[_VALID_SHARES[k]] * v
        else:
            out[k] = acc[k] + weight * v
    return out


def _packed_rows(batch: Batch) -> Batch:
    """The packed rows' arrays of a packed batch (with shared prompts, `prefix_ids` too)."""
    return {k: batch[k] for k in ("tokens", "positions", "segment_ids", "attn_mask",
                                  "prefix_ids") if k in batch}


def span_index(span: jax.Array, response_len: int) -> jax.Array:
    """i32[slots, G] response index of token-budget slots from their `resp_span` i32[slots, 3]
    (`packing.SLOT_KEYS`): start + t for first <= t < end, 0 elsewhere."""
    t = jnp.arange(response_len, dtype=span.dtype)
    start, first, end = (span[:, i:i + 1] for i in range(3))
    return jnp.where((t >= first) & (t < end), start + t, 0)


def _resp_index(batch: Batch) -> jax.Array:
    """A packed (micro-)batch's response index: `resp_index`, or widened from `resp_span`."""
    if "resp_index" in batch:
        return batch["resp_index"]
    return span_index(batch["resp_span"], batch["resp_mask"].shape[1])


def _gather_sequences(batch: Batch) -> Batch:
    """A token-budget packed batch with its per-sequence arrays in `seq_index`'s slots (empty
    slots: no response token in the loss, advantage 0)."""
    index = batch["seq_index"]
    real = index >= 0
    out = {}
    for k, v in batch.items():
        if k == "seq_index":
            continue
        if k in packing_lib.PACKED_KEYS + packing_lib.SHARED_KEYS + packing_lib.SLOT_KEYS:
            out[k] = v
            continue
        x = jnp.take(v, jnp.maximum(index, 0), axis=0)
        out[k] = jnp.where(real.reshape(-1, *([1] * (x.ndim - 1))), x, jnp.zeros_like(x))
    return out


@dataclasses.dataclass(frozen=True)
class OptimConfig:
    """AdamW with global-norm clipping and a linear warm-up into a cosine or constant schedule."""

    learning_rate: float = 1e-6
    warmup_steps: int = 0
    decay_steps: int = 0  # cosine decay length after warm-up; 0 = constant
    end_lr_ratio: float = 0.0
    weight_decay: float = 0.01
    b1: float = 0.9
    b2: float = 0.999
    eps: float = 1e-8
    grad_clip: float = 1.0


def learning_rate_schedule(cfg: OptimConfig) -> optax.Schedule:
    """lr at optimizer step 0, 1, ...: a linear warm-up lr * (step + 1) / warmup_steps (the first
    step already moves; it reaches lr at step warmup_steps - 1), then cosine decay to
    lr * end_lr_ratio over decay_steps or constant. lr 0 is allowed (a control run)."""
    lr, warmup, decay = cfg.learning_rate, cfg.warmup_steps, cfg.decay_steps
    end = lr * cfg.end_lr_ratio

    def schedule(count: jax.Array) -> jax.Array:
        step = jnp.asarray(count, jnp.float32)
        out = jnp.asarray(lr, jnp.float32)
        if decay > 0:
            frac = jnp.clip((step - warmup) / decay, 0.0, 1.0)
            out = end + (lr - end) * 0.5 * (1.0 + jnp.cos(jnp.pi * frac))
        if warmup > 0:
            out = jnp.where(step < warmup, lr * (step + 1.0) / warmup, out)
        return out

    return schedule


def make_optimizer(cfg: OptimConfig) -> optax.GradientTransformation:
    if cfg.learning_rate < 0:
        raise ValueError(f"optim.learning_rate must be >= 0, got {cfg.learning_rate}")
    if cfg.warmup_steps < 0 or cfg.decay_steps < 0:
        raise ValueError(f"optim.warmup_steps={cfg.warmup_steps} and optim.decay_steps="
                         f"{cfg.decay_steps} must be >= 0")
    chain = [optax.clip_by_global_norm(cfg.grad_clip)] if cfg.grad_clip > 0 else []
    # AdamW scales the decoupled weight decay by the learning rate too: lr 0 changes nothing.
    chain.append(optax.adamw(learning_rate_schedule(cfg), b1=cfg.b1, b2=cfg.b2, eps=cfg.eps,
                             weight_decay=cfg.weight_decay))
    return optax.chain(*chain)


def _products_for(mesh: Mesh) -> Any:
    """The model's products on the mesh's platform: on XLA:CPU with weight gradients as plain
    row-major products (`models.cpu_weight_grads`), elsewhere `lax.dot_general`."""
    cpu = platform_of(mesh) == "cpu"
    return cpu_weight_grads.dot_general if cpu else jax.lax.dot_general


class Learner:
    """Holds the jitted, sharded `logprobs` and `update` functions for one model and mesh.

    Memory knobs (per device, with b = rows of one micro-batch on one device, T = P + G):
      num_micro_batches: the update's batch is cut into this many micro-batches (a scan).
      remat: `Remat` of each decoder layer in the backward ('none' | 'dots' | 'full').
      scan_layers: run the decoder layers as one `lax.scan` (`Transformer.scan_layers`): one
        compiled layer body, and remat's recomputation ordered layer by layer (unrolled, XLA:CPU
        schedules it early and keeps every layer's recomputed activations: the 1.5B update takes
        55 GiB instead of 9). Off, small models run ~20% faster on CPU.
      logprob_chunk: response positions per LM-head chunk; the logits cost b * chunk * V * 4 bytes.
      logprob_batch_size: rows per forward pass in `logprobs` (a scan over slices of the batch);
        0 = the whole batch at once. The trainer passes the update's micro-batch size.
    The attention implementation is `model_config.attention`.

    precision: the training precision, a `quant` recipe name or `Recipe` (`train.precision`):
      'fp' runs plain matmuls; 'fp8_block' runs the recipe's linear layers in block-scaled FP8 in
      the forward and backward of both `logprobs` (pi_prox, pi_ref) and `update` (Jet-RL's
      unified flow when the rollout runs 'fp8_block' too). Master weights, optimizer state,
      attention, norms and the LM head stay in float. Other recipes raise ValueError.
    packing: pack each micro-batch's sequences into rows of `pack_length` tokens (0: the batch's
      P + G rounded up to the attention block, `packing.default_pack_length`) before the
      programs run (see the module doc); `last_pack` holds the latest batch's rows and real-token
      share.
    tokens_per_micro_batch: with packing, the update's micro-batches are sized by packed tokens
      instead of `num_micro_batches`: rows of tokens_per_micro_batch // pack_length (per process,
      rounded up to its devices), as many micro-batches as the (mini)batch's sequences need,
      rounded up to a bucket (`packing.bucket_rows`); empty padding micro-batches, rows and
      sequence slots carry no loss. 0: `num_micro_batches` micro-batches of sequences. The
      log-prob recomputation runs in slices of the same packed rows (`logprob_batch_size` is
      then unused), its log-probs scattered back to [B, G].
    pack_buckets: sizes per doubling of the packed row and micro-batch counts the programs are
      compiled for (`packing.bucket_rows`; a power of two): 8 leaves at most 1/8 of them padding,
      fewer compile fewer programs (where a compile costs more than the padding it saves).
    update_capture: a rollout recipe whose `quant.update_capture` of this update (the parameters
      before against after) the update program reports as `quant/*` metrics, so a caller
      needs no copy of the old parameters beside the update (`RunSettings.capture_in_update`).
    cpu_dots: on XLA:CPU, which library runs the update's and log-prob passes' float products
      (`train.cpu_dots`, `runtime.xla_cpu`: 'auto' takes Eigen's instead of YNNPACK's on a CPU
      without AVX512); other platforms ignore it.
    share_prompts: with packing, the batch's sequences come in groups of this many that share
      their prompt (GRPO's samples of a prompt, prompt-major; 1: no sharing), and each group's
      prompt is packed and run once, its responses attending to it (`packing.pack_budget` with
      `group`; `train.share_prompts`): the same log-probs and gradients up to float rounding,
      for (group - 1) fewer prompts per group. Micro-batches then hold whole groups: token-budget
      ones with `tokens_per_micro_batch`, else `num_micro_batches` of them. Float training
      precision and dense attention only (packed rows of at most 1024 tokens).
    lora: a `lora.LoraConfig` to train its adapter on a frozen base instead of every parameter:
      `params` is then the adapter (replicated on the mesh) and `logprobs` / `update` take the
      base as `frozen` (read where it lies, as `lora.learner_products` says, never donated;
      `policy`).
    """

    def __init__(self, model_config: ModelConfig, objective: ObjectiveConfig, optim: OptimConfig,
                 mesh: Mesh, *, temperature: float = 1.0, num_micro_batches: int = 1,
                 remat: Remat | str = Remat.NONE, scan_layers: bool = False,
                 logprob_chunk: int = 512, logprob_batch_size: int = 0,
                 precision: str | quant.Recipe = "fp", packing: bool = False,
                 pack_length: int = 0, tokens_per_micro_batch: int = 0,
                 pack_buckets: int = packing_lib.PER_DOUBLING,
                 update_capture: str | quant.Recipe | None = None,
                 cpu_dots: str = "auto", share_prompts: int = 1,
                 lora: lora_lib.LoraConfig | None = None) -> None:
        objective.validate()
        quant.make_train_dot_general(precision)  # ValueError: unknown or not trainable
        self.precision = quant.get_recipe(precision)
        if num_micro_batches < 1:
            raise ValueError(f"num_micro_batches must be >= 1, got {num_micro_batches}")
        if logprob_chunk < 1:
            raise ValueError(f"logprob_chunk must be >= 1, got {logprob_chunk}")
        if logprob_batch_size < 0:
            raise ValueError(f"logprob_batch_size must be >= 0, got {logprob_batch_size}")
        if pack_length < 0:
            raise ValueError(f"train.pack_length must be >= 0, got {pack_length}")
        if tokens_per_micro_batch < 0:
            raise ValueError(f"train.tokens_per_micro_batch must be >= 0, got "
                             f"{tokens_per_micro_batch}")
        packing_lib.check_per_doubling(pack_buckets)
        if share_prompts > 1 and not packing:
            raise ValueError("train.share_prompts needs train.packing")
        if share_prompts > 1 and self.precision.quantizes:
            raise ValueError("train.share_prompts needs train.precision='fp'")
        try:
            remat = Remat(remat)
        except ValueError as e:
            raise ValueError(f"remat={remat!r} is not one of {[str(r) for r in Remat]}") from e
        self.model_config = model_config.validate()
        if lora is not None and self.precision.quantizes:
            raise ValueError(f"a LoRA learner trains on the frozen base's codes in float; "
                             f"precision={self.precision.name!r} must be 'fp'")
        self.lora = lora
        products = _products_for(mesh)
        if lora is not None:  # the frozen base's products, the adapters' as any float kernel's
            products = lora_lib.dot_general(lora_lib.learner_products(products))
        # On XLA:CPU a LoRA learner's program holds the base's weight-only codes widened to the
        # compute dtype (`lora.for_learner`).
        self._widen = model_config.compute_dtype if platform_of(mesh) == "cpu" else None
        self.model = Transformer(model_config, products, remat=remat,
                                 scan_layers=scan_layers, shard_activation=self._shard_activation)
        self.objective = objective
        self.mesh = mesh
        self.temperature = float(temperature)
        self.num_micro_batches = num_micro_batches
        self.logprob_chunk = logprob_chunk
        self.logprob_batch_size = logprob_batch_size
        self.tx = make_optimizer(optim)
        self._logical = param_logical_axes(model_config)
        self._update_fns: dict[Any, Callable] = {}
        self._logprob_fns: dict[Any, Callable] = {}
        self.packing = bool(packing)
        self.pack_length = int(pack_length)
        self.tokens_per_micro_batch = int(tokens_per_micro_batch)
        self.share_prompts = max(int(share_prompts), 1)
        self.pack_buckets = int(pack_buckets)
        self.last_pack: dict[str, float] = {}
        self.update_capture = None if update_capture is None else quant.get_recipe(update_capture)
        self._pack_cache: tuple[Any, int, Batch] | None = None
        self._budget_cache: tuple[Any, Batch, dict[str, float]] | None = None
        # Per-program XLA:CPU options of the update and log-prob programs (None: XLA's defaults).
        xla_cpu.resolve(cpu_dots)  # ValueError: not one of xla_cpu.CPU_DOTS
        self.compiler_options = (xla_cpu.learner_compiler_options(cpu_dots)
                                 if platform_of(mesh) == "cpu" else None)

    # ----------------------------------------------------------------------------------- placement
    def param_shardings(self, params: Any) -> Any:
        """Shardings of the trained parameters: the model's by their logical axes, or a LoRA
        adapter's, replicated (rank-r factors: every device reads them whole, the base's
        layout decides the products' partitioning)."""
        if self.lora is not None:
            repl = NamedSharding(self.mesh, PartitionSpec())
            return jax.tree.map(lambda _: repl, params)
        return shd.logical_shardings(self._logical, params, self.mesh)

    def policy(self, params: Any, frozen: Any = None) -> Any:
        """The model's parameters of the policy: `params` themselves, or with LoRA the frozen
        base (`frozen`, read as `model.lora.learner_products` says: `lora.for_learner`; on
        XLA:CPU its weight-only codes widened once per program call) with the adapter `params`
        attached."""
        if self.lora is None:
            return params
        if frozen is None:
            raise ValueError("a LoRA learner needs the frozen base (frozen=...)")
        base = lora_lib.for_learner(frozen, self.lora.learner_products, self._widen)
        return lora_lib.attach(base, params, self.lora.scale)

    @staticmethod
    def _frozen_shardings(frozen: Any) -> Any:
        """The frozen base's own shardings (it stays where it lies: the rollout's layout)."""
        return None if frozen is None else jax.tree.map(lambda x: x.sharding, frozen)

    def shard_params(self, params: Any) -> Any:
        """A copy of `params` on the mesh; never aliases the input, since `update` donates it.

        (`device_put(..., may_alias=False)` is not enough: a replicated placement can still reuse
        the source buffer as one of its shards, so the copy is made explicitly first.)
        """
        return jax.device_put(jax.tree.map(jnp.copy, params), self.param_shardings(params))

    def opt_state_shardings(self, params: Any) -> Any:
        """Shardings of the optimizer state: moments placed like the parameters, step counts
        replicated on the mesh. `params` may be arrays or `jax.ShapeDtypeStruct`s."""
        repl = NamedSharding(self.mesh, PartitionSpec())
        return optax.tree_map_params(
            self.tx, lambda _, sharding: sharding, jax.eval_shape(self.tx.init, params),
            self.param_shardings(params), transform_non_params=lambda _: repl)

    def init_opt_state(self, params: Any) -> Any:
        """Optimizer state placed like the parameters (moments share their shardings)."""
        return jax.jit(self.tx.init, in_shardings=(self.param_shardings(params),),
                       out_shardings=self.opt_state_shardings(params))(params)

    def abstract_state(self, params: Any) -> tuple[Any, Any]:
        """(params, optimizer state) as `jax.ShapeDtypeStruct`s carrying their mesh shardings, from
        parameter shapes (e.g. `jax.eval_shape` of `init_params`): what `update_fn(...).lower`
        needs to compile the update without allocating anything."""
        def place(x: Any, sharding: NamedSharding) -> jax.ShapeDtypeStruct:
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

        opt_state = jax.eval_shape(self.tx.init, params)
        return (jax.tree.map(place, params, self.param_shardings(params)),
                jax.tree.map(place, opt_state, self.opt_state_shardings(params)))

    def shard_batch(self, batch: Batch) -> Batch:
        return {k: jax.device_put(v, shd.batch_sharding(self.mesh, v.ndim))
                for k, v in batch.items()}

    def _shard_activation(self, x: jax.Array, logical: tuple[str, ...]) -> jax.Array:
        pin = shd.activation_pinner(self.mesh)  # None on one device: nothing to pin
        return x if pin is None else pin(x, logical)

    def _constrain_rows(self, rows: Batch) -> Batch:
        """Pins a slice of the batch (inside a scan) to the batch sharding, so the partitioner
        keeps its rows split over the devices instead of replicating the slice's compute."""
        return {k: self._shard_activation(v, ("batch",) + (None,) * (v.ndim - 1))
                for k, v in rows.items()}

    def _batch_shardings(self, batch: Batch) -> dict[str, NamedSharding]:
        return {k: shd.batch_sharding(self.mesh, v.ndim) for k, v in batch.items()}

    # ------------------------------------------------------------------------------------ packing
    def pack_batch(self, batch: Batch, num_slices: int) -> Batch:
        """The packed form of a padded batch (global arrays), its sequences cut into `num_slices`
        strided micro-batch slices: the `packing.PACKED_KEYS` (replacing tokens, positions and
        attn_mask) beside the per-sequence arrays. Each process packs its own rows; the row
        count is the largest any process's slice needs, rounded up to a bucket
        (`packing.bucket_rows`) and to the devices the rows split over."""
        tokens = batch["tokens"]
        cached = self._pack_cache
        if cached is not None and cached[0] is tokens and cached[1] == num_slices:
            packed = cached[2]
        else:
            local_tokens = dist.local_rows(tokens)
            mask = dist.local_rows(batch["attn_mask"])
            resp_mask = dist.local_rows(batch["resp_mask"]) if "resp_mask" in batch else None
            response_len = batch["resp_mask"].shape[1]
            length = self.pack_length or packing_lib.default_pack_length(local_tokens.shape[1])
            index, count = dist.row_block(self.mesh)
            shards = int(self.mesh.shape["data"] * self.mesh.shape["fsdp"]) // count
            used = dist.agree_max(packing_lib.rows_needed(mask, length, num_slices))
            # Every slice's rows split over this process's devices (`_constrain_rows`).
            rows = packing_lib.bucket_rows(used, shards, self.pack_buckets)
            host = packing_lib.pack(local_tokens, mask, response_len, length,
                                    num_slices=num_slices, num_rows=rows, resp_mask=resp_mask,
                                    row_offset=index * rows)
            self.last_pack = self._pack_metrics(host, count)
            packed = dist.global_batch(self.mesh, host.arrays)
            self._pack_cache = (tokens, num_slices, packed)
        out = {k: v for k, v in batch.items() if k not in ("tokens", "positions", "attn_mask")}
        out.update(packed)
        return out

    def _budget_rows(self, pack_length: int) -> tuple[int, int]:
        """(packed rows of one token-budget micro-batch on this process, processes)."""
        _, count = dist.row_block(self.mesh)
        shards = int(self.mesh.shape["data"] * self.mesh.shape["fsdp"]) // count
        rows = max(self.tokens_per_micro_batch // pack_length, 1)
        if rows * pack_length > self.tokens_per_micro_batch:
            raise ValueError(f"train.tokens_per_micro_batch={self.tokens_per_micro_batch} is less "
                             f"than one packed row of train.pack_length={pack_length} tokens")
        return -(-rows // shards) * shards, count

    @property
    def budget_packing(self) -> bool:
        """Whether batches are packed with `pack_budget_batch` (micro-batches named by
        `seq_index`): token-budget micro-batches, or shared prompts."""
        return self.packing and bool(self.tokens_per_micro_batch or self.share_prompts > 1)

    def _budget_micro(self, packed_rows: int, pack_length: int) -> tuple[int, int]:
        """(micro-batches, packed rows of each on this process) of a batch `pack_budget_batch`
        packed into `packed_rows` rows (this process's count times processes) of
        `pack_length`."""
        _, count = dist.row_block(self.mesh)
        if self.tokens_per_micro_batch:
            rows, _ = self._budget_rows(pack_length)
            return packed_rows // (rows * count), rows
        return self.num_micro_batches, packed_rows // (self.num_micro_batches * count)

    def pack_budget_batch(self, batch: Batch) -> Batch:
        """The padded batch packed into micro-batches of sequences of its own choosing
        (`packing.pack_budget`): token-budget ones (`tokens_per_micro_batch`), or with shared
        prompts `num_micro_batches` of whole groups. Returns the packed rows, `seq_index` and the
        response index of each micro-batch's slots (`resp_span`; with shared prompts
        `resp_index` and `packing.SHARED_KEYS`), the log-prob pass's `resp_flat` (no shared
        prompts), and the per-sequence arrays as they are (the update gathers them by
        `seq_index`). The counts of micro-batches, rows and sequences per micro-batch are agreed
        over processes (the largest, bucketed). The same batch again (the reference log-probs
        after pi_prox's) reuses the packing."""
        cached = self._budget_cache
        if cached is not None and cached[0] is batch["tokens"]:
            self.last_pack = cached[2]
            out = {k: v for k, v in batch.items() if k not in ("tokens", "positions",
                                                               "attn_mask")}
            out.update(cached[1])
            return out
        tokens = dist.local_rows(batch["tokens"])
        mask = dist.local_rows(batch["attn_mask"])
        resp_mask = dist.local_rows(batch["resp_mask"])
        response_len = batch["resp_mask"].shape[1]
        length = self.pack_length or packing_lib.default_pack_length(tokens.shape[1])
        index, count = dist.row_block(self.mesh)
        shards = int(self.mesh.shape["data"] * self.mesh.shape["fsdp"]) // count
        units = dict(group=self.share_prompts, response_len=response_len)
        if self.tokens_per_micro_batch:
            rows, _ = self._budget_rows(length)
            m = packing_lib.bucket_rows(dist.agree_max(
                packing_lib.budget_micro_batches(mask, length, rows, **units)), 1,
                self.pack_buckets)
        else:  # shared prompts in num_micro_batches micro-batches of whole groups
            m = self.num_micro_batches
            rows_in = packing_lib.budget_assignment(mask, length, m, **units)[1]
            rows = packing_lib.bucket_rows(dist.agree_max(int(rows_in.max(initial=0)) + 1),
                                           shards, self.pack_buckets)
        most = packing_lib.budget_assignment(mask, length, m, **units)[3]
        seqs = packing_lib.bucket_rows(dist.agree_max(most), shards, self.pack_buckets)
        host = packing_lib.pack_budget(tokens, mask, response_len, length, num_micro=m,
                                       rows_per_micro=rows, seqs_per_micro=seqs,
                                       resp_mask=resp_mask, row_offset=index * rows,
                                       seq_offset=index * tokens.shape[0],
                                       group=self.share_prompts)
        self.last_pack = {**self._pack_metrics(host, count), "learner/micro_batches": float(m)}
        packed = dist.global_batch(self.mesh, host.arrays)
        self._budget_cache = (batch["tokens"], packed, self.last_pack)
        out = {k: v for k, v in batch.items() if k not in ("tokens", "positions", "attn_mask")}
        out.update(packed)
        return out

    @staticmethod
    def _pack_metrics(host: packing_lib.Packed, count: int) -> dict[str, float]:
        """Packed rows and real-token share over every process's rows (a small collective)."""
        sums = dist.host_sums({"real": float(host.real_tokens),
                               "computed": float(host.arrays["tokens"].size)})
        return {"learner/packed_rows": float(host.rows * count),
                "learner/real_token_share": sums["real"] / max(sums["computed"], 1.0)}

    def _maybe_pack(self, batch: Batch, num_slices: int) -> Batch:
        if not self.packing or "segment_ids" in batch:
            return batch
        return self.pack_batch(batch, num_slices)

    # ---------------------------------------------------------------------------------- log-probs
    def logprobs(self, params: Any, batch: Batch, frozen: Any = None) -> jax.Array:
        """f32[B, G] response log-probs under `params` (the proximal or reference policy; with
        LoRA the adapter, on the frozen base `frozen`)."""
        b = batch["resp_mask"].shape[0]
        lbs = self.logprob_batch_size
        if self.budget_packing and "segment_ids" not in batch:
            # Token-budget slices (or shared prompts), as the update's micro-batches: rows of the
            # whole batch's sequences, not each slice of lbs sequences packed on its own (one
            # sequence per device packs into one row per device: no saving).
            batch = self.pack_budget_batch(batch)
        else:
            batch = self._maybe_pack(batch, b // lbs if lbs and lbs < b else 1)
        if "resp_flat" in batch:
            keys = ("tokens", "positions", "segment_ids", "attn_mask") + packing_lib.TOKEN_KEYS
        elif "seq_index" in batch:
            keys = packing_lib.PACKED_KEYS + ("seq_index", "resp_mask") + tuple(
                k for k in packing_lib.SHARED_KEYS if k in batch)
        else:
            keys = packing_lib.PACKED_KEYS if "segment_ids" in batch else batch.keys()
        batch = {k: batch[k] for k in keys}
        return self.logprobs_fn(params, batch, frozen)(params, batch, frozen)

    def logprobs_fn(self, params: Any, batch: Batch, frozen: Any = None) -> Callable:
        """The jitted `logprobs` for arrays shaped and placed like these (arrays or
        `jax.ShapeDtypeStruct`s with shardings); `.lower(params, batch, frozen)` compiles
        without data."""
        response_len = next(batch[k] for k in ("resp_flat", "resp_index", "resp_mask")
                            if k in batch).shape[1]
        key = (response_len, jax.tree.structure(batch),
               tuple((k, v.shape) for k, v in sorted(batch.items())))
        if key not in self._logprob_fns:
            fn = functools.partial(self._logprobs, response_len=response_len)
            repl = NamedSharding(self.mesh, PartitionSpec())
            self._logprob_fns[key] = jax.jit(
                fn, in_shardings=(self.param_shardings(params), self._batch_shardings(batch),
                                  self._frozen_shardings(frozen)),
                out_shardings=shd.batch_sharding(self.mesh, 2) if self.mesh.size > 1 else repl,
                compiler_options=self.compiler_options)
        return self._logprob_fns[key]

    def _logprobs(self, params: Any, batch: Batch, frozen: Any, response_len: int) -> jax.Array:
        params = self.policy(params, frozen)
        if "resp_flat" in batch:
            return self._token_logprobs(params, batch)
        if "seq_index" in batch:
            return self._budget_logprobs(params, batch)
        if "segment_ids" in batch:
            return self._packed_logprobs(params, batch)

        def forward(rows: Batch) -> jax.Array:
            rows = self._constrain_rows(rows)
            logp, _ = response_logprobs(self.model, params, rows["tokens"], rows["positions"],
                                        rows["attn_mask"], response_len, self.temperature,
                                        chunk=self.logprob_chunk, precision=self.precision)
            return logp

        rows = {k: batch[k] for k in ("tokens", "positions", "attn_mask")}
        b = rows["tokens"].shape[0]
        if not self.logprob_batch_size or self.logprob_batch_size >= b:
            return forward(rows)
        if b % self.logprob_batch_size:
            raise ValueError(f"logprob_batch_size={self.logprob_batch_size} does not divide the "
                             f"batch size {b}")
        return merge_rows(jax.lax.map(forward, split_rows(rows, b // self.logprob_batch_size)))

    def _packed_forward(self, params: Any, part: Batch) -> jax.Array:
        """Response log-probs f32[slots, G] of one slice of packed rows (`resp_index`'s slots)."""
        part = self._constrain_rows(part)
        logp, _ = packed_response_logprobs(self.model, params, _packed_rows(part),
                                           part["resp_index"], self.temperature,
                                           chunk=self.logprob_chunk, precision=self.precision,
                                           resp_target=part.get("resp_target"))
        return logp

    def _packed_logprobs(self, params: Any, batch: Batch) -> jax.Array:
        """`_logprobs` of a packed batch, one micro-batch slice at a time as packed."""
        forward = functools.partial(self._packed_forward, params)
        part = {k: batch[k] for k in packing_lib.PACKED_KEYS}
        b = part["resp_index"].shape[0]
        lbs = self.logprob_batch_size
        if not lbs or lbs >= b:
            return forward(part)
        return merge_rows(jax.lax.map(forward, split_rows(part, b // lbs)))

    def _budget_logprobs(self, params: Any, batch: Batch) -> jax.Array:
        """`_logprobs` of a token-budget packed batch (`pack_budget_batch`): one micro-batch of
        rows at a time (a `lax.map`), each slot's log-probs scattered back to its sequence's row
        of f32[B, G] (`seq_index`; sequences with no real token stay 0, as no loss reads them)."""
        forward = functools.partial(self._packed_forward, params)
        m, _ = self._budget_micro(*batch["tokens"].shape)
        b, g = batch["resp_mask"].shape

        def scatter(out: jax.Array, part: Batch) -> jax.Array:
            index = part["seq_index"]
            return out.at[jnp.where(index >= 0, index, b)].set(forward(part), mode="drop")

        part = {k: batch[k] for k in packing_lib.PACKED_KEYS + packing_lib.SHARED_KEYS
                + ("seq_index",) if k in batch}
        out = self._shard_activation(jnp.zeros((b, g), jnp.float32), ("batch", None))
        if m == 1:
            return scatter(out, part)
        # Each slice's log-probs go straight into [B, G] (the scan's carry): a stacked
        # [slices, slots, G] output would be as large as the worst case's slots.
        out, _ = jax.lax.scan(lambda acc, p: (scatter(acc, p), None), out, split_rows(part, m))
        return out

    def _token_logprobs(self, params: Any, batch: Batch) -> jax.Array:
        """`_logprobs` of token-budget micro-batches without shared prompts: each micro-batch's
        rows give every position's log-prob (a `lax.map`), merged back into row order, and
        `resp_flat` gathers f32[B, G] from them once. Its arrays are the rows' and [B, G], so
        the program is linear in the rollout however many sequences a micro-batch holds (a
        slot layout, `_budget_logprobs`, is micro-batches x slots x G in the worst case)."""
        m, _ = self._budget_micro(*batch["tokens"].shape)

        def forward(part: Batch) -> jax.Array:
            part = self._constrain_rows(part)
            return packed_token_logprobs(self.model, params, _packed_rows(part),
                                         self.temperature, chunk=self.logprob_chunk,
                                         precision=self.precision)

        rows = _packed_rows(batch)
        logp = forward(rows) if m == 1 else merge_rows(jax.lax.map(forward, split_rows(rows, m)))
        return logp.reshape(-1)[batch["resp_flat"]]

    # ------------------------------------------------------------------------------------- update
    def loss(self, params: Any, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The objective on one (micro-)batch; differentiable in `params`."""
        response_len = batch["resp_mask"].shape[1]
        need_entropy = self.objective.entropy_coef != 0.0
        if "segment_ids" in batch:
            logp, entropy = packed_response_logprobs(
                self.model, params, _packed_rows(batch), _resp_index(batch), self.temperature,
                chunk=self.logprob_chunk, with_entropy=need_entropy, precision=self.precision,
                resp_target=batch.get("resp_target"))
        else:
            logp, entropy = response_logprobs(
                self.model, params, batch["tokens"], batch["positions"], batch["attn_mask"],
                response_len, self.temperature, chunk=self.logprob_chunk,
                with_entropy=need_entropy, precision=self.precision)
        # pi_prox is these parameters (`learner.prox`) for every row without a recomputed
        # logp_prox, or for the rows prox_from_forward marks: this forward, gradient stopped.
        logp_prox = batch.get("logp_prox")
        marked = batch.get("prox_from_forward")
        counted = None  # the rows whose Sparse-RL counts this update reports
        if logp_prox is None:
            logp_prox, counted = jax.lax.stop_gradient(logp), batch["resp_mask"]
        elif marked is not None:
            logp_prox = jnp.where(marked[:, None], jax.lax.stop_gradient(logp), logp_prox)
            counted = batch["resp_mask"] * marked[:, None]
        loss, metrics = policy_loss(
            logp, logp_prox, batch["logp_behav"], batch["advantages"],
            batch["resp_mask"], self.objective,
            logp_ref=batch.get("logp_ref") if self.objective.kl_coef else None,
            entropy=entropy,
        )
        if counted is not None and self.objective.mode == Mode.SPARSE_RL:
            # The counts the trainer takes from a recomputed pi_prox, from this one instead.
            rejected = sparse_rl_rejections(logp_prox, batch["logp_behav"], counted,
                                            self.objective)
            metrics.update({f"sparse/{k}": v for k, v in rejected.items()})
        return loss, metrics

    def update(self, params: Any, opt_state: Any, batch: Batch, frozen: Any = None
               ) -> tuple[Any, Any, dict[str, jax.Array]]:
        """One optimizer step on `batch` (gradients accumulated over micro-batches).

        Donates `params` and `opt_state`; returns the new ones and scalar metrics. With LoRA
        `params` is the adapter and `frozen` the base it is attached to (read, never donated).
        """
        if self.budget_packing and "segment_ids" not in batch:
            batch = {k: v for k, v in self.pack_budget_batch(batch).items()
                     if k not in packing_lib.TOKEN_KEYS}  # the log-prob pass's, not the loss's
        else:
            batch = self._maybe_pack(batch, self.num_micro_batches)
        return self.update_fn(params, opt_state, batch, frozen)(params, opt_state, batch, frozen)

    def update_fn(self, params: Any, opt_state: Any, batch: Batch, frozen: Any = None
                  ) -> Callable:
        """The jitted `update` for arrays shaped and placed like these (arrays or
        `jax.ShapeDtypeStruct`s with shardings); `.lower(...)` compiles without data."""
        key = (jax.tree.structure(batch), tuple((k, v.shape) for k, v in sorted(batch.items())))
        if key not in self._update_fns:
            p_sh = self.param_shardings(params)
            o_sh = jax.tree.map(lambda x: x.sharding, opt_state)
            b_sh = self._batch_shardings(batch)
            repl = NamedSharding(self.mesh, PartitionSpec())
            self._update_fns[key] = jax.jit(
                self._update, in_shardings=(p_sh, o_sh, b_sh, self._frozen_shardings(frozen)),
                out_shardings=(p_sh, o_sh, repl), donate_argnums=(0, 1),
                compiler_options=self.compiler_options)
        return self._update_fns[key]

    def _update(self, params: Any, opt_state: Any, batch: Batch, frozen: Any = None):
        n = self.num_micro_batches
        if "seq_index" in batch:  # token-budget micro-batches: their sequences, gathered
            n, _ = self._budget_micro(*batch["tokens"].shape)
            batch = _gather_sequences(batch)
        b = batch["tokens"].shape[0]
        if b % n:
            raise ValueError(f"batch size {b} is not divisible by num_micro_batches={n}")
        grad_fn = jax.value_and_grad(lambda p, b: self.loss(self.policy(p, frozen), b),
                                     has_aux=True)
        if n == 1:
            (loss, metrics), grads = grad_fn(params, batch)
        else:
            micro = split_rows(batch, n)

            def body(acc, mb):
                mb = self._constrain_rows(mb)
                (loss_i, metrics_i), g_i = grad_fn(params, mb)
                w = loss_weight(metrics_i, self.objective.agg)
                loss, metrics, grads, total = acc
                return (loss + w * loss_i, _accumulate_metrics(metrics, metrics_i, w),
                        jax.tree.map(lambda a, g: a + w * g, grads, g_i), total + w), None

            zero_metrics = jax.eval_shape(lambda: grad_fn(params, jax.tree.map(
                lambda x: x[0], micro))[0][1])
            init = (jnp.zeros((), jnp.float32),
                    {k: jnp.full(s.shape, _metric_identity(k), s.dtype)
                     for k, s in zero_metrics.items()},
                    jax.tree.map(jnp.zeros_like, params), jnp.zeros((), jnp.float32))
            (loss, metrics, grads, total), _ = jax.lax.scan(body, init, micro)
            # Weighted by each micro-batch's loss normaliser (kept tokens or sequences): the
            # loss and gradient of the whole batch, not a mean of micro-batch means.
            inv = 1.0 / jnp.maximum(total, 1.0)
            loss, grads = loss * inv, jax.tree.map(lambda g: g * inv, grads)
            metrics = {k: v * inv if _metric_reduction(k) == "mean" else v
                       for k, v in metrics.items()}
            metrics.update({k: v / jnp.maximum(metrics[_VALID_SHARES[k]], 1.0)
                            for k, v in metrics.items() if k in _VALID_SHARES})
        grad_norm = optax.tree.norm(grads)
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        updates, new_opt_state = self.tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        keep = lambda new, old: jnp.where(ok, new, old)  # noqa: E731
        new_params = jax.tree.map(keep, new_params, params)
        new_opt_state = jax.tree.map(keep, new_opt_state, opt_state)
        metrics = dict(metrics)
        metrics.update({"update/loss": loss, "update/grad_norm": grad_norm,
                        "update/skipped": 1.0 - ok.astype(jnp.float32)})
        if self.update_capture is not None:  # inside the program: no copy of the old params
            capture = quant.update_capture(params, new_params, self.update_capture)
            metrics.update({f"quant/{k}": v for k, v in capture.items()})
        return new_params, new_opt_state, metrics
