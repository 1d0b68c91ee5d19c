"""LoRA on a frozen, quantized base: one copy of the base shared by the rollout and the learner.

`model.lora.rank > 0` makes a run train low-rank adapters instead of every parameter. The base is
quantized ONCE (`quantize_base`: the rollout recipe's int8 / FP8 codes, or the compute dtype) and
never changes; the rollout samples `attach(base, adapter)` through the recipe's own product
(W8A8 for 'int8'), the learner differentiates the same tree through a weight-only product of the
same codes or the rollout's own W8A8 product (`model.lora.learner_products`, `learner_base`,
`learner_products`), so only the adapter (float32) and its optimizer state move. `peft` writes
the adapter as a Hugging Face PEFT adapter; `merge` gives the plain float model for
`--export_hf`. The math and the choices (why not `qwix`) are in docs/lora.md.
"""

from qurl_jax.lora._adapter import (
    BASE_PRECISIONS,
    LEARNER_PRODUCTS,
    PROJECTIONS,
    LoraConfig,
    LoraKernel,
    adapter_at,
    adapter_shapes,
    attach,
    base_shapes,
    check_base_recipe,
    dot_general,
    fingerprint,
    init_adapter,
    merge,
    quantize_base,
    target_paths,
    weight_only,
)
from qurl_jax.lora._learner import (
    for_learner,
    is_w8a8_linear,
    learner_base,
    learner_policy,
    learner_products,
    w8a8_linear,
)

__all__ = [
    "BASE_PRECISIONS",
    "LEARNER_PRODUCTS",
    "PROJECTIONS",
    "LoraConfig",
    "LoraKernel",
    "adapter_at",
    "adapter_shapes",
    "attach",
    "base_shapes",
    "check_base_recipe",
    "dot_general",
    "fingerprint",
    "for_learner",
    "init_adapter",
    "is_w8a8_linear",
    "learner_base",
    "learner_policy",
    "learner_products",
    "merge",
    "quantize_base",
    "target_paths",
    "w8a8_linear",
    "weight_only",
]
