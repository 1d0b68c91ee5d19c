"""Inspecting a run: the resolved config saved and compared on resume, the rollout share of step
time defined once, the before-RL evaluation read back after a resume, and --quick's note."""

import pytest

from qurl_jax.config import run_config
from qurl_jax.config.base import base_config
from qurl_jax.config.run_config import ResumeConfigError
from qurl_jax.runtime.metrics import eval_at, format_summary, rollout_share
from qurl_jax.study import runner as study


def test_resume_with_a_changed_math_field_stops_naming_it(tmp_path):
    c = base_config()
    run_config.check_and_save(c, str(tmp_path), resuming=False)
    changed = base_config()
    changed.rl.cap = 5.0
    with pytest.raises(ResumeConfigError, match=r"config.rl.cap is 5.0 but .* started with 2.0"):
        run_config.check_and_save(changed, str(tmp_path), resuming=True)
    # A fresh start (no checkpoint) takes the new config without a word.
    run_config.check_and_save(changed, str(tmp_path), resuming=False)


def test_a_run_saved_before_a_math_field_existed_resumes_with_its_old_behaviour(tmp_path):
    # rollout.quantize_vocab came after runs had started with bf16 vocabulary tables: such a
    # run's saved config lacks it and resumes only with the value it ran with (False).
    import json

    c = base_config()
    run_config.check_and_save(c, str(tmp_path), resuming=False)
    path = tmp_path / run_config.FILE
    saved = json.loads(path.read_text())
    del saved["rollout.quantize_vocab"]
    path.write_text(json.dumps(saved))
    with pytest.raises(ResumeConfigError,
                       match=r"config.rollout.quantize_vocab is True but .* started with False"):
        run_config.check_and_save(c, str(tmp_path), resuming=True)
    c.rollout.quantize_vocab = False
    run_config.check_and_save(c, str(tmp_path), resuming=True)


def test_resume_with_logging_only_changes_is_logged_and_saved(tmp_path, caplog):
    c = base_config()
    run_config.check_and_save(c, str(tmp_path), resuming=False)
    longer = base_config()
    longer.train.num_steps = 500
    longer.mesh.fsdp = -1
    with caplog.at_level("INFO"):
        run_config.check_and_save(longer, str(tmp_path), resuming=True)
    assert "train.num_steps changed from 100 to 500" in caplog.text
    assert "mesh.fsdp changed from 1 to -1" in caplog.text


def test_rollout_share_is_the_share_of_all_step_time():
    rows = [{"step": 1, "time/rollout_s": 9.0, "time/update_s": 1.0, "time/step_s": 10.0,
             "time/rollout_share": 0.9},
            {"step": 2, "time/rollout_s": 1.0, "time/update_s": 89.0, "time/step_s": 90.0,
             "time/rollout_share": 1 / 90}]
    # 10 s of 100 s, as time_split.png's legend; not the mean of the per-step shares (0.456).
    assert rollout_share(rows) == pytest.approx(0.1)


def test_before_rl_evaluation_is_read_back_from_the_metrics():
    rows = [{"step": 0, "eval/arith/avg@4": 0.25, "eval/arith/pass@4": 0.5},
            {"step": 1, "rollout/reward_mean": 0.1},
            {"step": 3, "eval/arith/avg@4": 0.75}]
    before = eval_at(rows, 0)
    assert before == {"arith/avg@4": 0.25, "arith/pass@4": 0.5}
    text = format_summary({"eval_before": before, "eval_after": {"arith/avg@4": 0.75}})
    assert "nan" not in text and "+0.5000" in text


def test_quick_study_says_it_is_a_smoke_test():
    assert "smoke test" in study.QUICK_NOTE and "0.000" in study.QUICK_NOTE
