"""`bench.lora_step`: the two shipped configs it compares differ only in the learner (the same
rollout, RL, data, reward and memory settings), and the table counts only like-for-like steps."""

from __future__ import annotations

import pytest

from qurl_jax.bench import lora_step
from qurl_jax.config.base import load_config_file


def _config(tmp_path, side: str):
    path = tmp_path / f"{side}.py"
    path.write_text(lora_step.config_source(side, 3, "/models/m.gguf"))
    return load_config_file(str(path))


def test_the_sides_share_the_rollout_and_differ_in_the_learner(tmp_path) -> None:
    full, lora = _config(tmp_path, "full"), _config(tmp_path, "lora")
    for c in (full, lora):
        assert c.train.num_steps == 3 and tuple(c.eval.files) == ()
        assert c.model.path == "/models/m.gguf"
    for section in ("rollout", "rl", "data", "reward"):
        assert full[section].to_dict() == lora[section].to_dict(), section
    for key in ("scan_layers", "malloc_arenas", "malloc_trim_steps"):
        assert full.train[key] == lora.train[key], key
    assert full.optim.warmup_steps == lora.optim.warmup_steps
    assert full.model.lora.rank == 0 and lora.model.lora.rank == 16
    assert (lora.model.lora.learner_products, lora.train.remat) == ("w8a8", "projections")
    with pytest.raises(ValueError, match="--order: 'half'"):
        lora_step.config_source("half", 3)


def _run(side: str, seconds: list[float], rows: list[int], peak: float) -> dict:
    return {"side": side, "peak_gb": peak, "steps": [
        {"step": s, "rollout": 10.0, "update": s - 10.0, "rows": r}
        for s, r in zip(seconds, rows, strict=True)]}


def test_summary_takes_steps_from_2_with_the_same_packed_rows_in_every_run() -> None:
    runs = [_run("full", [99, 70, 80, 60], [64, 64, 48, 64], 6.0),
            _run("lora", [70, 40, 41, 30], [64, 64, 64, 64], 3.0),
            _run("lora", [70, 42, 41, 32], [64, 64, 64, 64], 3.5),
            _run("full", [99, 72, 80], [64, 64, 64], 6.2)]
    summary = lora_step.summarize(runs)
    assert summary["steps"] == [2]  # 1 compiles, 3 differs in rows, 4 is not in every run
    assert summary["sides"]["full"]["step"] == 71.0 and summary["sides"]["lora"]["step"] == 41.0
    assert summary["full_over_lora"]["step"] == pytest.approx(71 / 41)
    assert summary["full_over_lora"]["rollout"] == 1.0
    assert summary["peak_lora_over_full"] == pytest.approx(3.5 / 6.2)
    text = lora_step.table(summary, runs, "a CPU")
    assert "1.73x" in text and "70.0 / 72.0 (mean 71.0)" in text
    with pytest.raises(ValueError, match="no step from 2 on"):
        lora_step.summarize([_run("full", [99, 70], [64, 56], 6.0),
                             _run("lora", [70, 40], [64, 64], 3.0)])
