"""QuRL's update-aware quantization (UAQ): invariant scaling of a norm gain and its consumers.

For a linear layer fed by an RMSNorm, y = W^T (gamma * n(x)) with n(x) = x / rms(x). The norm's
output is linear in its gain, so scaling the gain by s and the consuming kernels by 1/s leaves y
unchanged: (W / s)^T (s * gamma * n(x)) = W^T (gamma * n(x)); biases are added after the product
and stay as they are. The function is unchanged in exact arithmetic (and in fp32 up to rounding),
but the quantized copy is not: the kernels' quantization step shrinks by s, and the learner's
gradient with respect to W / s grows by s (dL/dW = x dL/dy^T and x is s times larger), so a small
RL update is less likely to be rounded away (QuRL Eq. 11-12; s = 1.5).

Where the inverse scale goes, per target group:
- 'qkv': `input_layernorm/scale` *= s; `self_attn/{q,k,v}_proj/kernel` /= s. With Qwen3's per-head
  q_norm / k_norm the identity holds before those norms (q = (W_q / s)^T (s h) is the same q), so
  they see the same input.
- 'gate_up': `post_attention_layernorm/scale` *= s; `mlp/{gate,up}_proj/kernel` /= s.
`o_proj` and `down_proj` are refused: their inputs (attention output, silu(gate) * up) are not a
norm output, so there is no gain to absorb the scale into without changing the function.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from flax import traverse_util

Params = dict[str, Any]

# target group -> (norm module, parent of the consumers, consumer modules)
TARGETS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    "qkv": ("input_layernorm", "self_attn", ("q_proj", "k_proj", "v_proj")),
    "gate_up": ("post_attention_layernorm", "mlp", ("gate_proj", "up_proj")),
}
_NOT_NORM_INPUT = {
    "o": "the attention output", "o_proj": "the attention output",
    "down": "silu(gate) * up", "down_proj": "silu(gate) * up",
}
_PART_OF_GROUP = {"q": "qkv", "k": "qkv", "v": "qkv", "q_proj": "qkv", "k_proj": "qkv",
                  "v_proj": "qkv", "gate": "gate_up", "up": "gate_up", "gate_proj": "gate_up",
                  "up_proj": "gate_up"}


def _check_target(target: str) -> None:
    if target in TARGETS:
        return
    if target in _NOT_NORM_INPUT:
        raise ValueError(
            f"invariant_scaling: target {target!r} cannot be scaled: its input is "
            f"{_NOT_NORM_INPUT[target]}, not a norm output, so no norm gain can absorb the scale"
        )
    if target in _PART_OF_GROUP:
        raise ValueError(
            f"invariant_scaling: target {target!r} shares its norm output with its group; scale "
            f"the whole group {_PART_OF_GROUP[target]!r}"
        )
    raise ValueError(
        f"invariant_scaling: unknown target {target!r}; known targets: {sorted(TARGETS)}"
    )


def invariant_scaling(params: Params, s: float = 1.5,
                      targets: Sequence[str] = ("qkv",)) -> Params:
    """gamma *= s and the consuming kernels /= s for every decoder layer and target group.

    Args:
      params: the model's float `params` pytree (layers `layers_{i}` with HF-style module names).
      s: positive scale (QuRL: 1.5; 1.0 returns an equal tree).
      targets: groups among 'qkv' (after the input norm) and 'gate_up' (after the post-attention
        norm).

    Returns a new pytree (the input is not modified); leaves keep their dtype and sharding.
    Raises ValueError naming a target that is unknown, is not fed by a norm, or is absent.
    """
    if isinstance(targets, str):
        targets = (targets,)
    try:
        s = float(s)
    except (TypeError, ValueError) as e:
        raise ValueError(f"invariant_scaling: s={s!r} is not a number") from e
    if not (math.isfinite(s) and s > 0):
        raise ValueError(f"invariant_scaling: s={s!r} must be a positive finite number")
    for target in targets:
        _check_target(target)
    flat = dict(traverse_util.flatten_dict(params))
    for target in dict.fromkeys(targets):
        norm, parent, consumers = TARGETS[target]
        norm_paths = [p for p in flat if p[-2:] == (norm, "scale")]
        if not norm_paths:
            raise ValueError(
                f"invariant_scaling: target {target!r} needs '{norm}/scale' but the parameters "
                f"have no such leaf"
            )
        for norm_path in norm_paths:
            layer = norm_path[:-2]
            flat[norm_path] = flat[norm_path] * s
            for name in consumers:
                path = (*layer, parent, name, "kernel")
                if path not in flat:
                    raise ValueError(
                        f"invariant_scaling: target {target!r}: '{'/'.join(path)}' is missing"
                    )
                flat[path] = flat[path] / s
    return traverse_util.unflatten_dict(flat)
