"""Rewards: math_verify equivalence, format and exact match, hard timeouts, the batch pool."""

import concurrent.futures
import operator
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from qurl_jax.data import (
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

# 9^(9^9) has ~370 million digits: sympy's evaluation runs for minutes.
ADVERSARIAL = "Surely it is \\boxed{9^{9^{9}}}."

# (response, reference answer(s), correct?) labelled by hand.
MATH_CASES = [
    ("So the answer is \\boxed{\\frac{1}{2}}.", "0.5", 1.0),
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("\\boxed{\\dfrac12}", "1/2", 1.0),
    ("We get $x = \\boxed{2\\sqrt{2}}$", "\\sqrt{8}", 1.0),
    ("\\boxed{142}", "142", 1.0),
    ("\\boxed{x=5}", "5", 1.0),
    ("\\boxed{[0, 1)}", "[0,1)", 1.0),
    ("\\boxed{\\{1, 2\\}}", "$2$, $1$", 1.0),
    ("First \\boxed{3}, no wait, \\boxed{4}", "4", 1.0),
    ("\\boxed{6630}", ("6630.65", "6630"), 1.0),
    ("\\boxed{3}", "4", 0.0),
    ("\\boxed{0.51}", "0.5", 0.0),
    ("\\boxed{\\frac{1}{3}}", "0.5", 0.0),
    ("The answer is 1/2", "1/2", 0.0),  # no boxed answer
    ("\\boxed{}", "1/2", 0.0),
    ("\\boxed{1/2", "1/2", 0.0),  # unclosed
    ("First \\boxed{4}, no wait, \\boxed{3}", "4", 0.0),
    ("\\boxed{6631}", ("6630.65", "6630"), 0.0),
]


@pytest.fixture(scope="module")
def computer():
    with RewardComputer(math_reward, num_workers=2, timeout_s=2.0) as rc:
        yield rc


@pytest.mark.parametrize("response, answer, expected", MATH_CASES)
def test_math_reward_cases(response, answer, expected):
    assert math_reward(response, answer) == expected


@pytest.mark.parametrize(
    "text, expected",
    [("a \\boxed{1} b", "1"), ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"), ("\\boxed {7}", "7"),
     ("\\boxed{1} \\boxed{2}", "2"), ("\\boxed{2} \\boxed{3", "2"), ("none", None)],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize(
    "response, expected",
    [("x \\boxed{12} y", 1.0), ("\\boxed{1} \\boxed{2}", 0.0), ("12", 0.0), ("\\boxed{ }", 0.0),
     ("\\boxed{12", 0.0), ("\\boxed{\\frac{a}{b}}", 1.0)],
)
def test_format_reward(response, expected):
    assert format_reward(response) == expected


def test_math_format_reward():
    assert math_format_reward("\\boxed{4}", "4") == pytest.approx(1.0)
    assert math_format_reward("\\boxed{5}", "4") == pytest.approx(0.1)
    assert math_format_reward("\\boxed{3} \\boxed{4}", "4", 0.2) == pytest.approx(0.8)
    assert math_format_reward("4", "4") == 0.0


@pytest.mark.parametrize(
    "response, answer, expected",
    [("19", "19", 1.0), (" 19\n", "19", 1.0), ("\\boxed{19}", "19", 1.0), ("19.0", "19", 0.0),
     ("19 19", "19", 0.0), ("-3", "-3", 1.0), ("3", "-3", 0.0), ("", "19", 0.0),
     ("7", ("6", "7"), 1.0)],
)
def test_exact_match_reward(response, answer, expected):
    assert exact_match_reward(response, answer) == expected


def test_adversarial_input_is_cut_off_within_bound():
    with VerifierPool(num_workers=1, timeout_s=1.0) as pool:
        assert pool.call(verify_math_answer, "\\boxed{2}", "2") == ("ok", 1.0)  # warm start
        start = time.monotonic()
        status, _ = pool.call(verify_math_answer, ADVERSARIAL, "3")
        elapsed = time.monotonic() - start
        assert status == "timeout"  # it really does not finish in a second
        assert elapsed < 2.5
        # The hung worker was replaced; the pool keeps working.
        assert pool.call(verify_math_answer, "\\boxed{1/2}", "0.5") == ("ok", 1.0)
        assert pool.call(operator.truediv, "a", "b")[0] == "error"
        assert pool.call(operator.add, 2, 3) == ("ok", 5)
        assert pool.call(os._exit, 3)[0] == "crash"


def test_math_reward_timeout_from_a_thread():
    math_reward("\\boxed{1}", "1")  # warm start of the shared worker
    results = []

    def score():
        start = time.monotonic()
        results.append((math_reward(ADVERSARIAL, "3", timeout_s=1.0), time.monotonic() - start))

    thread = threading.Thread(target=score)
    thread.start()
    thread.join(timeout=30)
    (reward, elapsed), = results
    assert reward == 0.0 and elapsed < 2.5
    assert math_reward("\\boxed{2}", "2") == 1.0


def test_workers_outlive_the_thread_that_started_them():
    pools = []

    def start():
        pool = VerifierPool(num_workers=1)
        pools.append((pool, pool.call(os.getpid)))

    thread = threading.Thread(target=start)
    thread.start()
    thread.join(timeout=60)
    (pool, (status, pid)), = pools
    time.sleep(0.5)
    with pool:
        assert status == "ok" and pool.call(os.getpid) == ("ok", pid)


def test_pool_matches_serial(computer):
    responses = [r for r, _, _ in MATH_CASES]
    answers = [a for _, a, _ in MATH_CASES]
    serial = [math_reward(r, a) for r, a in zip(responses, answers, strict=True)]  # one at a time
    assert serial == [e for _, _, e in MATH_CASES]
    assert computer(responses, answers) == serial
    future = computer.submit(responses + [ADVERSARIAL], answers + ["3"])
    assert isinstance(future, concurrent.futures.Future)
    pooled = future.result(timeout=60)
    assert pooled == serial + [0.0]
    expected_stats = {"calls": 2 * len(serial) + 1, "timeouts": 1, "errors": 0, "crashes": 0,
                      "worker_failures": 0}
    assert computer.stats == expected_stats


def test_reward_computer_in_threads_and_errors():
    with RewardComputer(exact_match_reward, num_workers=2, use_processes=False) as rc:
        assert rc(["19", "\\boxed{7}", "8"], ["19", "7", "9"]) == [1.0, 1.0, 0.0]
    with RewardComputer(operator.truediv, num_workers=1, use_processes=False) as rc:
        assert rc(["a"], ["b"]) == [0.0]
        assert rc.stats["errors"] == 1
    rewards = compute_rewards(["\\boxed{2}", "3"], ["2", "2"], exact_match_reward, 1, 1.0, False)
    assert rewards == [1.0, 0.0]
    with pytest.raises(ValueError, match="picklable"):
        RewardComputer(lambda r, a: 1.0)
    with pytest.raises(ValueError, match="2 responses but 1 answers"):
        RewardComputer(exact_match_reward, use_processes=False).submit(["a", "b"], ["a"])


FLAKY_INIT = """
import os

def check():
    if os.path.exists(os.environ["QURL_TEST_FAIL_MARKER"]):
        raise RuntimeError("worker start-up failed (test)")
"""


def test_failed_worker_start_scores_zero_and_the_pool_recovers(tmp_path, monkeypatch):
    (tmp_path / "flaky_init.py").write_text(FLAKY_INIT)
    marker = tmp_path / "fail"
    monkeypatch.syspath_prepend(str(tmp_path))  # spawned workers inherit the import path
    monkeypatch.setenv("QURL_TEST_FAIL_MARKER", str(marker))
    with VerifierPool(num_workers=1, timeout_s=5.0, preload=("flaky_init:check",)) as pool:
        assert pool.call(operator.add, 1, 2) == ("ok", 3)
        marker.touch()  # from now on no replacement worker can start
        assert pool.call(os._exit, 3)[0] == "crash"
        status, reason = pool.call(operator.add, 1, 2)
        assert status == "unavailable" and reason
        rc = RewardComputer(exact_match_reward, num_workers=1)
        rc._pool.close()
        rc._pool = pool
        assert rc(["19", "7"], ["19", "7"]) == [0.0, 0.0]  # scored 0, the batch is not lost
        assert rc.stats["worker_failures"] == 2
        marker.unlink()  # start-up works again: the next call gets a fresh worker
        assert pool.call(operator.add, 2, 2) == ("ok", 4)


ORPHAN_PARENT = """
import os, signal, sys
from qurl_jax.data import VerifierPool
pool = VerifierPool(num_workers=2, timeout_s=60.0, preload=())
pids = {pool.call(os.getpid)[1] for _ in range(8)}
print(" ".join(map(str, sorted(pids))), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status", encoding="utf-8") as f:
            return "\tZ" not in f.read().split("State:")[1][:4]
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="parent-death signal is Linux")
def test_workers_die_with_a_killed_parent():
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(ORPHAN_PARENT)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    pids = [int(p) for p in proc.stdout.split()]
    assert pids
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)
