"""Metric rows after a resume: the steps a resumed run redoes appear once in metrics.jsonl."""

from qurl_jax.runtime.metrics import MetricWriter, read_metrics


def test_resume_drops_the_rows_of_redone_steps(tmp_path):
    writer = MetricWriter(str(tmp_path), tensorboard=False)
    writer.write(0, {"eval/acc": 0.1})
    for step in range(1, 6):
        writer.write(step, {"loss": float(step)})
    writer.close()
    # The run was killed after step 5 and resumes from its checkpoint at step 3.
    writer = MetricWriter(str(tmp_path), resume_step=3, tensorboard=False)
    assert [r["step"] for r in read_metrics(str(tmp_path))] == [0, 1, 2, 3]
    for step in (4, 5):
        writer.write(step, {"loss": 10.0 * step})
    writer.close()
    rows = read_metrics(str(tmp_path))
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4, 5]
    assert rows[-1]["loss"] == 50.0
    # Starting over from step 0 (no checkpoint) keeps nothing of the earlier attempt.
    MetricWriter(str(tmp_path), resume_step=0, tensorboard=False).close()
    assert read_metrics(str(tmp_path)) == []


def test_tensorboard_writer_opens_on_resume(tmp_path):
    MetricWriter(str(tmp_path)).close()
    writer = MetricWriter(str(tmp_path), resume_step=2)
    writer.write(3, {"loss": 1.0})
    writer.close()
    assert read_metrics(str(tmp_path))[-1] == {"step": 3, "loss": 1.0}
