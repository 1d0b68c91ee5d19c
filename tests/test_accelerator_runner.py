"""The accelerator runner (`python -m tests.accelerator`), run on the CPU in a reduced form so it
cannot rot: its files are written and parse, a run killed mid-way keeps the results it finished,
a spent time budget skips the rest with the reason, and the selection names only real tests."""

from __future__ import annotations

import ast
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from tests import accelerator_selection as sel

ROOT = Path(__file__).resolve().parent.parent
LINE = re.compile(r"^(PASSED|FAILED|ERROR|SKIPPED|XFAILED|XPASSED) +(\d+\.\d+)s (\S+)(  -- (.*))?$")

FAKE = '''
import time

import pytest


def test_a_passes():
    pass


def test_b_fails():
    assert 1 + 1 == 3, "one plus one"


def test_c_skips():
    pytest.skip("not here")


def test_d_sleeps():
    time.sleep({sleep})
'''


def _runner(out: Path, *args: str, **kwargs) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, "-m", "tests.accelerator", str(out), "--workers", "1",
         "--cache-dir", str(out / "cache"), *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, **kwargs)


def _results(out: Path) -> tuple[list[tuple[str, str, str]], list[str]]:
    """(outcome, node id, message) of each result line of summary.txt, and its other lines."""
    results, other = [], []
    for line in (out / "summary.txt").read_text().splitlines():
        if m := LINE.match(line):
            results.append((m[1], m[3], m[5] or ""))
        else:
            other.append(line)
    return results, other


def _junit(out: Path) -> dict[str, str]:
    """name -> 'passed' | 'failure' | 'error' | 'skipped' from junit.xml (which must parse)."""
    suite = ET.parse(out / "junit.xml").getroot()
    cases = {}
    for case in suite.iter("testcase"):
        kinds = [child.tag for child in case]
        cases[case.get("name")] = kinds[0] if kinds else "passed"
    assert int(suite.get("tests")) == len(cases)
    return cases


def _fake_tests(tmp_path: Path, sleep: float) -> Path:
    path = tmp_path / "fake" / "test_fake.py"
    path.parent.mkdir()
    path.write_text(FAKE.format(sleep=sleep))
    return path


def test_selection_names_existing_tests_of_selected_files() -> None:
    """Cheap rot check (the runner also fails on a stale key at collection)."""
    for key in (*sel.EXCLUDE, *sel.NEEDS_DEVICES):
        path, _, name = key.partition("::")
        assert path in sel.FILES, f"{key}: {path} is not in FILES"
        tree = ast.parse((ROOT / path).read_text())
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert not name or name in names, f"{key}: no such test function"
    assert all((ROOT / f).exists() for f in sel.FILES)


def test_real_selection_on_cpu_writes_parsable_results(tmp_path) -> None:
    out = tmp_path / "out"
    proc = _runner(out, "--files", "tests/test_objectives.py", "tests/test_attention.py",
                   "-k", "mis_levels_hand_values or sparse_rl_hand_values or cudnn_matches")
    log, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, log
    results, other = _results(out)
    assert {(o, n.split("::")[1].split("[")[0]) for o, n, _ in results} == {
        ("PASSED", "test_mis_levels_hand_values"), ("PASSED", "test_sparse_rl_hand_values"),
        ("SKIPPED", "test_cudnn_matches_dense_left_padded")}
    assert "# compute_dtype: bfloat16" in other and any(o.startswith("# platform: ") for o in other)
    assert re.match(r"== 2 passed, 2 skipped in [\d.]+s \(pytest exit status 0\)", other[-1])
    assert sorted(_junit(out).values()) == ["passed", "passed", "skipped", "skipped"]
    selected = (out / "selection.txt").read_text().splitlines()
    assert "tests/test_objectives.py::test_mis_levels_hand_values" in selected
    assert "tests/test_objectives.py::test_import_stays_light  # excluded: " + \
        sel.EXCLUDE["tests/test_objectives.py::test_import_stays_light"] in selected


def test_a_run_killed_mid_way_keeps_its_finished_results(tmp_path) -> None:
    out = tmp_path / "out"
    proc = _runner(out, "--files", str(_fake_tests(tmp_path, sleep=600)))
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            if (out / "summary.txt").exists() and len(_results(out)[0]) >= 3:
                break
            assert proc.poll() is None, proc.stdout.read()
            time.sleep(0.2)
        else:
            pytest.fail("no results within 120 s")
        time.sleep(0.5)  # inside test_d's sleep
    finally:
        proc.send_signal(signal.SIGKILL)  # the runner exec'd pytest: this pid is the run
        proc.communicate(timeout=60)
    results, other = _results(out)
    assert [(o, n.rsplit("::", 1)[1]) for o, n, _ in results] == [
        ("PASSED", "test_a_passes"), ("FAILED", "test_b_fails"), ("SKIPPED", "test_c_skips")]
    assert "one plus one" in results[1][2] and results[2][2] == "not here"
    assert not any(line.startswith("==") for line in other)  # killed: no totals line
    assert _junit(out) == {"test_a_passes": "passed", "test_b_fails": "failure",
                           "test_c_skips": "skipped"}
    assert "assert 1 + 1 == 3" in (out / "failures.txt").read_text()


def test_spent_budget_skips_what_has_not_started(tmp_path) -> None:
    out = tmp_path / "out"
    proc = _runner(out, "--budget", "0.001", "--files", str(_fake_tests(tmp_path, sleep=0)))
    log, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, log
    results, other = _results(out)
    assert len(results) == 4 and all(o == "SKIPPED" and "time budget" in m for o, _, m in results)
    assert re.match(r"== 4 skipped in", other[-1])


def test_bad_arguments_name_the_flag() -> None:
    proc = subprocess.run([sys.executable, "-m", "tests.accelerator", "/nonexistent/out",
                           "--files", "tests/test_no_such_file.py"], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode != 0 and "--files: no such file: tests/test_no_such_file.py" in \
        proc.stderr, textwrap.shorten(proc.stderr, 300)


def test_every_tolerance_has_both_reasons_and_is_documented() -> None:
    from tests.tolerances import TABLE

    doc = ROOT / "docs" / "accelerators.md"
    for name, by_dtype in TABLE.items():
        assert "bfloat16" in by_dtype and all(t.reason for t in by_dtype.values()), name
        if doc.exists():  # a Bazel sandbox holds no docs/
            assert f"`{name}`" in doc.read_text(), f"{name} is not in docs/accelerators.md"
