"""What a run prints while it works (`qurl_jax.runtime.progress`): progress lines off a terminal,
the heartbeat when the log goes silent, and, from the command line, an evaluation's progress and
its one-line results in the captured output of a run that is not on a terminal."""

from __future__ import annotations

import io
import logging
import re
import time

from qurl_jax.runtime import progress
from qurl_jax.train.tasks import result_line


def test_clock_formats_minutes_and_hours():
    assert [progress.clock(s) for s in (0, 59.6, 61, 3599, 3600, 3725, float("nan"))] == [
        "0:00", "1:00", "1:01", "59:59", "1:00:00", "1:02:05", "?"]


def test_progress_off_a_terminal_logs_start_updates_and_end(caplog):
    stream = io.StringIO()  # not a terminal: no bar, plain lines
    with caplog.at_level(logging.INFO):
        report = progress.Progress("eval test, greedy", 8, "problems", every_s=0.0, stream=stream)
        report.update(2, tokens=100)
        report.update(8, tokens=400)  # the last update: the closing line says it
        report.close()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("eval test")]
    assert stream.getvalue() == ""
    assert lines[0] == "eval test, greedy: 0/8 problems"
    assert re.fullmatch(r"eval test, greedy: 2/8 problems, [\d,]+ tokens/s, 0:00 so far, about "
                        r"0:00 left", lines[1]), lines[1]
    assert re.fullmatch(r"eval test, greedy: 8/8 problems, [\d,]+ tokens/s, 0:00 so far",
                        lines[2]), lines[2]
    assert len(lines) == 3


def test_progress_lines_wait_for_their_interval(caplog):
    with caplog.at_level(logging.INFO):
        report = progress.Progress("steps", 100, "steps", every_s=3600.0, stream=io.StringIO())
        for done in range(1, 100):
            report.update(done)
        report.close()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("steps")]
    assert lines == ["steps: 0/100 steps", lines[-1]] and lines[-1].startswith("steps: 99/100")


def test_heartbeat_speaks_only_when_the_log_is_silent():
    said = []
    beat = progress.Heartbeat(every_s=0.2, status=lambda: "about 1:00 left in the run",
                              log=said.append).start()
    try:
        beat.doing("step 3: update")
        time.sleep(0.7)
        assert said and said[0].startswith("step 3: update: 0:00 so far; about 1:00 left")
        quiet = len(said)
        for _ in range(8):  # lines flowing: no heartbeat
            logging.getLogger("qurl_test").warning("working")
            time.sleep(0.05)
        assert len(said) <= quiet + 1
    finally:
        beat.stop()


def test_heartbeat_is_not_silenced_by_lines_the_quiet_filter_drops():
    # orbax logs dozens of INFO records on every checkpoint save, which the CLI's filter keeps out
    # of its output (`runtime.quiet`): they must not count as lines, or the log goes silent for
    # longer than the heartbeat's interval (61 s seen in a SmolLM2 run).
    from qurl_jax.runtime import quiet

    quiet.quiet_libraries()
    said = []
    beat = progress.Heartbeat(every_s=0.3, log=said.append).start()
    try:
        beat.doing("saving")
        chatter = logging.getLogger("absl")
        for _ in range(16):  # a record from orbax's source: filtered out, not a line
            chatter.handle(chatter.makeRecord("absl", logging.INFO, "/site-packages/orbax/x.py",
                                              1, "Renaming ...", (), None))
            time.sleep(0.05)
        assert said and said[0].startswith("saving: 0:00 so far"), said
    finally:
        beat.stop()


def test_result_line_has_every_figure_of_an_evaluation():
    metrics = {"test/avg@4": 0.111, "test/pass@4": 0.32, "test/num_examples": 256.0,
               "test/greedy_acc": 0.203, "test/greedy_truncated": 0.141}
    assert result_line(metrics) == ("test: greedy 20.3%, avg@4 11.1%, pass@4 32.0%, greedy cut "
                                    "off 14.1%, 256 problems")


def test_a_run_off_a_terminal_prints_the_evaluations_progress_and_results(tmp_path):
    """The CLI's captured output (a pipe, not a terminal) holds each evaluation's progress, from
    0 problems to all with tokens/s, its one-line results, and the step's line with its seconds
    and the run's time left. The evaluation's rows wait for 4 slots: the refilling sampler
    reports as rows finish."""
    from tests.test_trainer import _main

    proc = _main(str(tmp_path), "--config.train.num_steps=1",
                 "--config.rollout.max_concurrent_rows=4")
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out[-3000:]
    for when in ("before RL", "after RL"):
        assert re.search(rf"evaluation {when} \(\d+:\d\d(, \d+ s of it compiling \d+ "
                         r"programs)?\): arith: greedy \d+\.\d%, avg@4 \d+\.\d%, pass@4 \d+\.\d%, "
                         r"greedy cut off \d+\.\d%, 4 problems", out), out[-3000:]
    assert "eval arith, 4 samples at T=1: 0/4 problems" in out
    assert re.search(r"eval arith, 4 samples at T=1: 4/4 problems, [\d,]+ tokens/s", out)
    assert re.search(r"eval arith, greedy: 4/4 problems, [\d,]+ tokens/s", out)
    assert re.search(r"step 1/1: \d+\.\d s, reward .*; about \d+:\d\d left in the run", out)
