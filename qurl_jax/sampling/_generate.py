"""Text in, text out: tokenizes prompts (optionally through the chat template), samples, decodes.

For the command line and for evaluation, where the inputs are strings and the outputs are strings;
RL training calls `Sampler.sample` on token ids directly.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from qurl_jax.sampling._host import Params
from qurl_jax.sampling.settings import SamplingParams


def _eos_ids(tokenizer: Any) -> tuple[int, ...]:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list | tuple) else (int(eos),)


def encode_prompts(texts: Sequence[str], tokenizer: Any, chat_template: bool = False
                   ) -> list[list[int]]:
    """Token ids per text; with `chat_template` each text becomes one user turn followed by the
    assistant generation prompt."""
    if chat_template:
        return [
            list(tokenizer.apply_chat_template(
                [{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True,
                return_dict=False,
            ))
            for t in texts
        ]
    return [list(tokenizer.encode(t, add_special_tokens=True)) for t in texts]


def generate(
    sampler: Any,
    params: Params,
    texts: Sequence[str],
    tokenizer: Any,
    settings: SamplingParams,
    *,
    key: jax.Array,
    chat_template: bool = False,
    n: int = 1,
    skip_special_tokens: bool = True,
) -> list[str]:
    """Samples `n` completions per text with `sampler` (`Sampler` or `RefillSampler`) and returns
    them decoded (B * n strings, prompt-major).

    `settings.eos_ids` None means the tokenizer's EOS id(s). The EOS token itself is dropped from
    the text when `skip_special_tokens` is set (the tokenizer decides what is special).
    """
    if isinstance(texts, str):
        raise ValueError("texts must be a list of strings, not one string")
    prompts = encode_prompts(texts, tokenizer, chat_template)
    if settings.eos_ids is None:
        settings = settings.replace(eos_ids=_eos_ids(tokenizer))
    out = sampler.sample(params, prompts, settings, key=key, n=n)
    tokens = np.asarray(out.tokens)
    lengths = np.asarray(out.lengths)
    return [
        tokenizer.decode(tokens[i, : lengths[i]].tolist(), skip_special_tokens=skip_special_tokens)
        for i in range(tokens.shape[0])
    ]
