"""A LoRA adapter in Hugging Face PEFT's format: adapter_config.json + adapter_model.safetensors.

PEFT (`peft.PeftModel.from_pretrained(base, path)`) loads it onto the Hugging Face base model:
the tensors are `base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_A.weight` [r, in]
(our a [in, r], transposed) and `...lora_B.weight` [out, r] (b [r, out], transposed), scaled by
lora_alpha / r, as ours. Written with `safetensors`' numpy API: no torch needed.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
from flax import traverse_util
from safetensors.numpy import save_file

from qurl_jax.lora._adapter import LoraConfig, adapter_at

ADAPTER_DIR = "lora_adapter"  # beside the merged model of `--export_hf`
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"


def hf_module(path: tuple[str, ...]) -> str:
    """Our module path ('layers_3', 'self_attn', 'q_proj') as Hugging Face's
    'model.layers.3.self_attn.q_proj'."""
    layer, *rest = path
    if not layer.startswith("layers_"):
        raise ValueError(f"lora.peft: adapter module {'/'.join(path)} is not in a decoder layer")
    return ".".join(["model", "layers", layer.removeprefix("layers_"), *rest])


def adapter_modules(adapter: Any) -> list[tuple[str, ...]]:
    """The adapted modules' paths, in flattening order."""
    return [p[:-1] for p in traverse_util.flatten_dict(adapter) if p[-1] == "a"]


def adapter_config(adapter: Any, cfg: LoraConfig, base_model: str) -> dict[str, Any]:
    """PEFT's `LoraConfig` as JSON: the projections by name when every layer adapts the same
    ones, else every adapted module by its full name (PEFT matches a name or a dotted suffix)."""
    modules = adapter_modules(adapter)
    names = sorted({m[-1] for m in modules})
    layers = sorted({m[0] for m in modules})
    uniform = len(modules) == len(names) * len(layers)
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.rank,
        "lora_alpha": cfg.alpha, "lora_dropout": 0.0, "bias": "none",
        "target_modules": names if uniform else [hf_module(m) for m in modules],
        "base_model_name_or_path": base_model, "fan_in_fan_out": False,
        "init_lora_weights": True, "inference_mode": True, "use_rslora": False,
        "use_dora": False, "modules_to_save": None, "revision": None,
    }


def save_adapter(path: str, adapter: Any, cfg: LoraConfig, base_model: str = "") -> None:
    """Writes `adapter` (host or device arrays) to directory `path` in PEFT's format;
    `base_model`: the Hugging Face base it belongs to (`base_model_name_or_path`)."""
    os.makedirs(path, exist_ok=True)
    tensors = {}
    for module in adapter_modules(adapter):
        name = f"base_model.model.{hf_module(module)}"
        node = adapter_at(adapter, module)
        tensors[f"{name}.lora_A.weight"] = np.ascontiguousarray(np.asarray(node["a"],
                                                                           np.float32).T)
        tensors[f"{name}.lora_B.weight"] = np.ascontiguousarray(np.asarray(node["b"],
                                                                           np.float32).T)
    save_file(tensors, os.path.join(path, WEIGHTS_FILE), metadata={"format": "pt"})
    with open(os.path.join(path, CONFIG_FILE), "w", encoding="utf-8") as f:
        json.dump(adapter_config(adapter, cfg, base_model), f, indent=2, sort_keys=True)
