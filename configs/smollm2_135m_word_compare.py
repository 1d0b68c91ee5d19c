"""The papers' comparison on real weights: configs/smollm2_135m_word.py, shrunk to fit one CPU.

The rollout-precision study runs one variant per rollout precision and correction from this
config (docs/study.md):

    python -m qurl_jax.study --config=configs/smollm2_135m_word_compare.py --out=/tmp/compare \
        --variants=fp,int8_naive,int8_tis,int8_acr --seeds=1 --steps=8 --jobs=1

Every run starts from the real instruct model (no warm start). Same task, batch and learning rate
as the single run; only the evaluation after RL is cut to the first 64 held-out problems (greedy
and Avg@4) so that a run of 8 steps takes about 15 minutes on 2 cores. The before-RL row is the
first run's.
"""

import os

from qurl_jax.config.base import load_config_file

_BASE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "smollm2_135m_word.py")


def get_config():
    c = load_config_file(_BASE)
    c.eval.max_examples = 64
    # The comparison's rows were all run without the single run's warm-up and overlong
    # punishment: kept so, one variable a row (docs/study.md gives the warm-up its own probe).
    c.optim.warmup_steps = 0
    c.rl.overlong_buffer = 0
    return c
