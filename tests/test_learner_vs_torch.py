"""`bench.learner --vs_torch`: both workers run the same tokens, the figures come back whole."""

import math

import numpy as np
import pytest

from qurl_jax.bench import learner_vs_torch


def test_batch_has_prompts_and_responses_in_range():
    host = learner_vs_torch.batch(6, 24, 20, 100, seed=1)
    prompt = host["attn_mask"][:, :24].sum(1)
    resp = host["resp_mask"].sum(1)
    assert host["tokens"].shape == (6, 44) and host["tokens"].max() < 100
    assert prompt.min() >= 20 and prompt.max() <= 24 and resp.min() >= 16 and resp.max() <= 20
    # Left-padded prompts, right-padded responses, positions counting real tokens only.
    last = 24 + resp.astype(int) - 1  # each row's last real token
    assert (host["positions"][range(6), last] == host["attn_mask"].sum(1) - 1).all()


@pytest.mark.slow  # a torch and a jax worker, each compiling a 1-layer SmolLM2-shaped model
@pytest.mark.parametrize("apart,cpu_dots", [(False, "auto"), (True, "eigen")])
def test_one_layer_comparison_runs(apart, cpu_dots):
    pytest.importorskip("transformers")
    lines = []
    out = learner_vs_torch.run(rows=4, max_prompt_len=24, max_new_tokens=20, rounds=1, layers=1,
                               log=lines.append, apart=apart, cpu_dots=cpu_dots)
    # Apart: ours, torch, torch, ours, one process at a time, a timed round each visit.
    assert len(out) and sum(line.startswith("visit") for line in lines) == (4 if apart else 0)
    for key in ("ours/seconds", "torch/seconds", "ours_logprobs/seconds", "ours/cpu_seconds",
                "torch/cpu_seconds", "ours/peak_rss_gb", "torch/peak_rss_gb"):
        assert math.isfinite(out[key]) and out[key] > 0, key
    assert out["ratio_update_ours_over_torch"] == out["ours/seconds"] / out["torch/seconds"]
    shares = [v for k, v in out.items() if k.startswith("ours/op_share_")]
    assert len(shares) == 3 and abs(sum(shares) - 1.0) < 1e-9
    # What the shares cover: the traced operations' seconds beside the profiled update's.
    assert out["ours/op_traced_seconds"] > 0 and out["ours/profiled_update_seconds"] > 0


def test_op_time_split_sorts_xla_operations_by_kind(tmp_path):
    import gzip
    import json

    ops = (("ynn_fusion.3", 4e6), ("dot.1", 1e6), ("copy_bitcast_fusion.7", 2e6), ("copy", 1e6),
           ("add_select_fusion.2", 5e5), ("wrapped_scatter.1", 5e5))
    starts = np.cumsum([0] + [d for _, d in ops])  # one after another
    events = [{"ph": "X", "name": n, "ts": float(t), "dur": d, "args": {"hlo_op": n}}
              for (n, d), t in zip(ops, starts, strict=False)]
    events += [{"ph": "X", "name": n, "ts": 0.0, "dur": 9e9} for n in (  # host side: no HLO op
        "ThunkExecutor::Execute", "$api.py:2479 block_until_ready", "shard_args")]
    events += [{"ph": "i", "name": "dot.2", "ts": 0.0, "dur": 9e9}]
    (tmp_path / "run").mkdir()
    with gzip.open(tmp_path / "run" / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    assert learner_vs_torch.op_time_split(str(tmp_path)) == {
        "matmul": 5.0, "transpose": 3.0, "other": 1.0}
    assert learner_vs_torch.op_time_split(str(tmp_path / "none")) == {}


def test_op_time_split_times_asynchronous_operations_to_their_end_marker(tmp_path):
    """Eigen's products (`cpu_dots='learner'`) return from their event at launch; the thunk
    executor's "end: <name>" marker says when they finished. Each start takes the first end of
    its name after it; an operation without a marker keeps its own duration; time with a
    product in flight is the product's, whatever else runs beside it."""
    import gzip
    import json

    events = [
        {"ph": "X", "name": "dot_general.3", "ts": 1e6, "dur": 2e3,
         "args": {"hlo_op": "dot_general.3"}},  # launched; ends at 4e6
        {"ph": "X", "name": "end: dot_general.3", "ts": 5e5, "dur": 1.0},  # a previous run's
        {"ph": "X", "name": "end: dot_general.3", "ts": 4e6, "dur": 1.0},
        {"ph": "X", "name": "dot_general.3", "ts": 6e6, "dur": 1e6,
         "args": {"hlo_op": "dot_general.3"}},  # the next run's: 1 s
        {"ph": "X", "name": "end: dot_general.3", "ts": 7e6, "dur": 1.0},
        {"ph": "X", "name": "wrapped_tanh", "ts": 4e6, "dur": 5e5,
         "args": {"hlo_op": "wrapped_tanh"}},  # synchronous, no marker
        {"ph": "X", "name": "copy.2", "ts": 8e6, "dur": 2.5e5,
         "args": {"hlo_op": "copy.2"}},
        {"ph": "X", "name": "end: copy.2", "ts": 8.25e6, "dur": 1.0},
        {"ph": "X", "name": "dot.9", "ts": 9e6, "dur": 1e6,
         "args": {"hlo_op": "dot.9"}},  # 9-10 s, with a fusion 9.5-10.5 s
        {"ph": "X", "name": "add_fusion", "ts": 9.5e6, "dur": 1e6,
         "args": {"hlo_op": "add_fusion"}},
    ]
    (tmp_path / "run").mkdir()
    with gzip.open(tmp_path / "run" / "perfetto_trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    assert learner_vs_torch.op_time_split(str(tmp_path)) == {
        "matmul": 5.0, "transpose": 0.25, "other": 1.0}
