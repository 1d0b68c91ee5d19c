"""What one `sample` call draws, as one frozen value: `SamplingParams`.

The host drivers check it once (`check`) and split it in two for the programs: the static part,
which selects a compiled program (`mode`: greedy, top-k, whether a top-p cut applies), and the
traced part (`Decoding`: temperature, top-p threshold, EOS ids), so new values of those do not
compile again.
"""

from __future__ import annotations

import dataclasses

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from qurl_jax.sampling._distributions import SamplingMode

BEHAV_LOGPS = ("sampled", "untruncated")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """The sampling settings of a call.

    max_new_tokens: response length limit (at most the sampler's largest generation bucket).
    temperature: softmax temperature (> 0); logits are divided by it in float32. With greedy
      decoding it only sets the temperature of the reported log-probs (1 if <= 0).
    top_k: keep the k most likely tokens (0 = off).
    top_p: nucleus threshold in (0, 1] (1 = off).
    greedy: arg-max decoding (ignores the key, top_k and top_p).
    eos_ids: token ids that end a response (the EOS token is part of the response); kept sorted
      and distinct. None: none (`generate`: the tokenizer's EOS ids).
    behav_logp: which log-prob a learner takes as the behaviour policy's (`behaviour_logp`):
      'sampled' (under the truncated, renormalised distribution that drew the token) or
      'untruncated' (under the full tempered softmax).
    """

    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    greedy: bool = False
    eos_ids: tuple[int, ...] | None = None
    behav_logp: str = "sampled"

    def __post_init__(self) -> None:
        if self.eos_ids is not None:
            object.__setattr__(self, "eos_ids", tuple(sorted({int(e) for e in self.eos_ids})))

    def replace(self, **changes: object) -> SamplingParams:
        return dataclasses.replace(self, **changes)

    def check(self, vocab_size: int, max_new_tokens: int) -> SamplingParams:
        """Raises ValueError naming the bad field (`max_new_tokens` is the sampler's limit)."""
        if not 1 <= self.max_new_tokens <= max_new_tokens:
            raise ValueError(f"max_new_tokens={self.max_new_tokens} must be in [1, "
                             f"{max_new_tokens}] (the largest generation bucket)")
        if not self.greedy and not self.temperature > 0:
            raise ValueError(f"temperature={self.temperature} must be > 0 (use greedy=True for "
                             f"arg-max)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise ValueError(f"top_k={self.top_k} must be >= 0 (0 disables top-k)")
        if any(not 0 <= e < vocab_size for e in self.eos_ids or ()):
            raise ValueError(f"eos_ids={self.eos_ids} has ids outside the vocabulary "
                             f"[0, {vocab_size})")
        if self.behav_logp not in BEHAV_LOGPS:
            raise ValueError(f"behav_logp={self.behav_logp!r} must be one of {BEHAV_LOGPS}")
        return self

    def mode(self, vocab_size: int) -> SamplingMode:
        """The static part: one compiled program per mode."""
        return SamplingMode(
            greedy=bool(self.greedy),
            top_k=0 if self.greedy or self.top_k >= vocab_size else int(self.top_k),
            top_p=not self.greedy and self.top_p < 1.0,
        )

    def decoding(self, key: jax.Array) -> Decoding:
        """The traced part, with the call's key. EOS ids are padded with -1 (matches no token) to
        a multiple of 8, so a new EOS set does not compile a new program; greedy decoding
        reports log-probs at the given temperature, or at 1 if it is not > 0."""
        ids = self.eos_ids or ()
        eos = np.full((-(-max(len(ids), 1) // 8) * 8,), -1, np.int32)
        eos[: len(ids)] = ids
        return Decoding(key=key,
                        temperature=jnp.float32(self.temperature if self.temperature > 0 else 1.0),
                        top_p=jnp.float32(self.top_p), eos_ids=jnp.asarray(eos))

    def behaviour_logp(self, logp: jax.Array, logp_untruncated: jax.Array) -> jax.Array:
        """The behaviour policy's per-token log-probs (`behav_logp`) of a `SampleOutput`."""
        return logp if self.behav_logp == "sampled" else logp_untruncated


@flax.struct.dataclass
class Decoding:
    """The traced sampling settings a decode program takes.

    key: the call's PRNG key (row i's token t is drawn with fold_in(fold_in(key, i), t));
    temperature, top_p: f32[]; eos_ids: i32[E], -1 padded.
    """

    key: jax.Array
    temperature: jax.Array
    top_p: jax.Array
    eos_ids: jax.Array

    @staticmethod
    def abstract(num_eos: int = 8) -> Decoding:
        """Its shapes and dtypes (for lowering programs without running them)."""
        scalar = jax.ShapeDtypeStruct((), jnp.float32)
        return Decoding(key=jax.eval_shape(lambda: jax.random.key(0)), temperature=scalar,
                        top_p=scalar, eos_ids=jax.ShapeDtypeStruct((num_eos,), jnp.int32))

    def is_eos(self, tok: jax.Array) -> jax.Array:
        """bool[R]: tok i32[R] is one of the EOS ids."""
        return jnp.any(tok[:, None] == self.eos_ids[None, :], axis=-1)

