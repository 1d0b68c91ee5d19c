"""Optional metric sinks (`train.loggers`): Weights & Biases gets every finite metric at its step
and one run per workdir; without the wandb package the run goes on with one warning line."""

import sys
import types

import pytest
from absl import logging

from qurl_jax.config.base import base_config, validate
from qurl_jax.runtime.metrics import MetricWriter, read_metrics


class _FakeRun:
    def __init__(self, **kwargs):
        self.kwargs, self.logged, self.finished = kwargs, [], False

    def log(self, metrics, step):
        self.logged.append((step, metrics))

    def finish(self):
        self.finished = True


def test_wandb_sink_logs_every_finite_metric(monkeypatch, tmp_path):
    runs = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kw: runs.append(_FakeRun(**kw)) or runs[-1]
    monkeypatch.setitem(sys.modules, "wandb", fake)
    writer = MetricWriter(str(tmp_path), tensorboard=False, wandb_project="p")
    writer.write(1, {"rollout/reward_mean": 0.5, "update/loss": float("nan")})
    writer.close()
    (run,) = runs
    assert run.logged == [(1, {"rollout/reward_mean": 0.5})] and run.finished
    assert run.kwargs["project"] == "p" and run.kwargs["resume"] == "allow"
    again = MetricWriter(str(tmp_path), resume_step=1, tensorboard=False, wandb_project="p")
    again.close()
    assert runs[1].kwargs["id"] == run.kwargs["id"]  # a restart continues the same run
    assert read_metrics(str(tmp_path))[0]["rollout/reward_mean"] == 0.5


def test_missing_wandb_is_skipped_with_one_line(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    warnings = []
    monkeypatch.setattr(logging, "warning", lambda fmt, *a: warnings.append(fmt % a))
    writer = MetricWriter(str(tmp_path), tensorboard=False, wandb_project="p")
    writer.write(1, {"x": 1.0})
    writer.close()
    assert len(warnings) == 1 and "wandb package is not installed" in warnings[0]
    assert read_metrics(str(tmp_path)) == [{"step": 1, "x": 1.0}]


def test_unknown_logger_is_a_config_error():
    c = base_config()
    c.model.source = "tiny"
    c.train.loggers = ("tensorboard", "mlflow")
    with pytest.raises(ValueError, match="train.loggers"):
        validate(c)


_TENSORBOARD = """
import glob, sys
from qurl_jax.runtime.metrics import MetricWriter
writer = MetricWriter(sys.argv[1], tensorboard=True)
writer.write(1, {"loss": 0.5})
writer.close()
assert "torch" not in sys.modules, "tensorboardX imported torch"
assert glob.glob(sys.argv[1] + "/tensorboard/events.out.tfevents.*")
import torch  # importable again afterwards
print("ok", torch.__name__)
"""


def test_tensorboard_sink_does_not_import_torch(tmp_path):
    """tensorboardX would import torch (about 1.8 s and 180 MB) when it is installed; the writer
    keeps it out of a process that had not imported it, and torch stays importable. A fresh
    process: this one may have imported torch already."""
    import subprocess

    pytest.importorskip("torch")
    out = subprocess.run([sys.executable, "-c", _TENSORBOARD, str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["ok", "torch"]
