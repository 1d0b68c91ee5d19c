"""Data, rewards and evaluation for RL with verifiable rewards: the public API of `qurl_jax.data`.

- Math sets: `load_math_file` reads JSON / JSONL / parquet files in the plain, DeepScaleR,
  DAPO-Math-17k or GSM8K layouts, skipping and counting bad rows (`LoadStats`); `build_prompt`
  applies `PROMPT_TEMPLATE` and the tokenizer's chat template; `PromptIterator` streams shuffled
  batches with a checkpointable position. The bundled sets live in `MATH_DATA_DIR`
  (`MATH_EVAL_SETS` names the evaluation files).
- Rewards: `math_reward` (math_verify equivalence of the last `\\boxed{}`, in a worker process
  with a hard timeout), `format_reward`, `math_format_reward`, `exact_match_reward`;
  `RewardComputer` / `compute_rewards` score batches in parallel, `RewardComputer.submit` returning
  a future so verification overlaps rollout and learning.
- The embedded default's synthetic task: `generate_arithmetic`, `arithmetic_splits`,
  `sft_pairs`, and `build_char_tokenizer` (a character-level Hugging Face tokenizer built in code).
- Evaluation: `evaluate` (Avg@k, Pass@k per data set) and `pass_at_k`.

Importing this package is light: transformers, tokenizers, pyarrow and math_verify are imported
only when first needed.
"""

# Math data sets and prompts
from qurl_jax.data.datasets import (
    MATH_DATA_DIR,
    MATH_EVAL_SETS,
    PROMPT_TEMPLATE,
    LoadStats,
    MathExample,
    PromptIterator,
    build_prompt,
    load_math_file,
    normalise_answer,
)

# Rewards
from qurl_jax.data.rewards import (  # isort: skip
    DEFAULT_TIMEOUT_S,
    RewardComputer,
    VerifierPool,
    compute_rewards,
    exact_match_reward,
    format_reward,
    last_boxed,
    math_format_reward,
    math_reward,
    verify_math_answer,
)

# Synthetic arithmetic task and character tokenizer
from qurl_jax.data.arithmetic import (  # isort: skip
    ARITHMETIC_TEMPLATE,
    ArithmeticConfig,
    arithmetic_prompt,
    arithmetic_splits,
    evaluate_expression,
    generate_arithmetic,
    sft_pairs,
)
from qurl_jax.data.tokenizer import build_char_tokenizer, char_vocab  # isort: skip

# Evaluation
from qurl_jax.data.evaluation import evaluate, pass_at_k  # isort: skip

__all__ = [
    "ARITHMETIC_TEMPLATE",
    "DEFAULT_TIMEOUT_S",
    "MATH_DATA_DIR",
    "MATH_EVAL_SETS",
    "PROMPT_TEMPLATE",
    "ArithmeticConfig",
    "LoadStats",
    "MathExample",
    "PromptIterator",
    "RewardComputer",
    "VerifierPool",
    "arithmetic_prompt",
    "arithmetic_splits",
    "build_char_tokenizer",
    "build_prompt",
    "char_vocab",
    "compute_rewards",
    "evaluate",
    "evaluate_expression",
    "exact_match_reward",
    "format_reward",
    "generate_arithmetic",
    "last_boxed",
    "load_math_file",
    "math_format_reward",
    "math_reward",
    "normalise_answer",
    "pass_at_k",
    "sft_pairs",
    "verify_math_answer",
]
