"""pytest plugin of the accelerator runner: the selection, and results streamed to OUTDIR.

Loaded by `python -m tests.accelerator` (`-p tests.accelerator_plugin`), configured through the
environment the runner sets:

- QURL_ACCELERATOR_OUT: the output folder. Written there, each file complete after every result, so
  a run killed at any point leaves the results it finished:
  `summary.txt` (a header, one line per result appended and flushed as it comes, a totals line at
  the end), `junit.xml` (rewritten by an atomic rename after every result), `failures.txt` (the
  full report of each failure or error), `selection.txt` (the selected node ids, then the excluded
  ones with their reasons).
- QURL_ACCELERATOR_DEADLINE: a Unix time; a test that has not started by then is skipped, with
  the reason, so a run cut by its time budget still ends with complete files.
- QURL_ACCELERATOR_INFO: a JSON object (platform, devices, jax version, compute dtype) for the
  header.
- QURL_ACCELERATOR_SELECT=1: apply `tests/accelerator_selection.py` (EXCLUDE, NEEDS_DEVICES).

Under pytest-xdist the selection runs in every worker (each collects the same items) and the
files are written by the controller, which receives every worker's reports.
"""

from __future__ import annotations

import json
import os
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass
from pathlib import Path

import pytest

OUTCOME_ORDER = ("passed", "failed", "error", "skipped", "xfailed", "xpassed")


@dataclass(frozen=True)
class Result:
    """One finished test phase worth reporting: `outcome` is one of OUTCOME_ORDER."""

    nodeid: str
    outcome: str
    seconds: float
    message: str
    details: str


def _is_worker(config: pytest.Config) -> bool:
    return hasattr(config, "workerinput")


def _matches(nodeid: str, prefix: str) -> bool:
    """A node id is under a prefix: the same id, or a parametrization / member of it."""
    return nodeid == prefix or nodeid.startswith((prefix + "[", prefix + "::"))


def _result_of(report: pytest.TestReport) -> Result | None:
    """The result a report stands for, or None for a phase that adds nothing (a passed setup)."""
    if report.when == "call":
        if hasattr(report, "wasxfail"):
            outcome = "xfailed" if report.skipped else "xpassed"
        else:
            outcome = report.outcome
    elif report.failed:
        outcome = "error"
    elif report.skipped and report.when == "setup":
        outcome = "skipped"
    else:
        return None
    message = ""
    if outcome == "skipped" and isinstance(report.longrepr, tuple):
        message = str(report.longrepr[2]).removeprefix("Skipped: ")
    elif outcome in ("failed", "error"):
        crash = getattr(report.longrepr, "reprcrash", None)
        message = crash.message if crash is not None else str(report.longrepr).splitlines()[-1]
        message = f"{report.when}: {message}" if outcome == "error" else message
    details = report.longreprtext if outcome in ("failed", "error") else ""
    return Result(report.nodeid, outcome, report.duration, " ".join(message.split()), details)


def _junit(results: list[Result], seconds: float) -> ET.ElementTree:
    counts = {o: sum(r.outcome == o for r in results) for o in OUTCOME_ORDER}
    suite = ET.Element("testsuite", name="qurl_jax.accelerator", tests=str(len(results)),
                       failures=str(counts["failed"] + counts["xpassed"]),
                       errors=str(counts["error"]),
                       skipped=str(counts["skipped"] + counts["xfailed"]), time=f"{seconds:.3f}")
    for r in results:
        path, _, name = r.nodeid.partition("::")
        classname = path.removesuffix(".py").replace("/", ".")
        case = ET.SubElement(suite, "testcase", classname=classname, name=name or path,
                             time=f"{r.seconds:.3f}")
        if r.outcome in ("failed", "xpassed"):
            ET.SubElement(case, "failure", message=r.message).text = r.details
        elif r.outcome == "error":
            ET.SubElement(case, "error", message=r.message).text = r.details
        elif r.outcome in ("skipped", "xfailed"):
            ET.SubElement(case, "skipped", message=r.message)
    return ET.ElementTree(suite)


class Recorder:
    """Streams each result to OUTDIR as it arrives (controller or single process only)."""

    def __init__(self, out: Path, info: dict) -> None:
        self.out = out
        self.results: list[Result] = []
        self.start = time.time()
        out.mkdir(parents=True, exist_ok=True)
        (out / "failures.txt").write_text("")
        self.summary = open(out / "summary.txt", "w", buffering=1)  # noqa: SIM115
        self.summary.write("# qurl_jax accelerator run: one line per result as it finishes\n")
        for key, value in info.items():
            self.summary.write(f"# {key}: {value}\n")
        self.summary.flush()
        self._write_junit()

    def add(self, result: Result) -> None:
        self.results.append(result)
        line = f"{result.outcome.upper():8s} {result.seconds:8.2f}s {result.nodeid}"
        if result.message:
            line += f"  -- {result.message[:300]}"
        self.summary.write(line + "\n")
        self.summary.flush()
        if result.details:
            with open(self.out / "failures.txt", "a") as f:
                f.write(f"{'=' * 30} {result.nodeid} ({result.outcome})\n{result.details}\n\n")
        self._write_junit()

    def _write_junit(self) -> None:
        tmp = self.out / "junit.xml.tmp"
        _junit(self.results, time.time() - self.start).write(tmp, encoding="utf-8",
                                                              xml_declaration=True)
        os.replace(tmp, self.out / "junit.xml")

    def finish(self, exitstatus: int) -> str:
        counts = {o: sum(r.outcome == o for r in self.results) for o in OUTCOME_ORDER}
        totals = ", ".join(f"{n} {o}" for o, n in counts.items() if n) or "no tests ran"
        line = f"== {totals} in {time.time() - self.start:.1f}s (pytest exit status {exitstatus})"
        self.summary.write(line + "\n")
        self.summary.close()
        self._write_junit()
        return line


def _apply_selection(config: pytest.Config, items: list[pytest.Item]) -> list[str]:
    """Deselects EXCLUDE, marks NEEDS_DEVICES; returns the lines for selection.txt beyond the
    selected ids: the excluded ones with their reasons, and keys that matched no test."""
    from tests import accelerator_selection as sel

    collected_files = {item.nodeid.partition("::")[0] for item in items}
    stale = [key for key in (*sel.EXCLUDE, *sel.NEEDS_DEVICES)
             if key.partition("::")[0] in collected_files
             and not any(_matches(item.nodeid, key) for item in items)]
    keep, dropped, excluded = [], [], []
    for item in items:
        reason = next((r for k, r in sel.EXCLUDE.items() if _matches(item.nodeid, k)), None)
        if reason is not None:
            dropped.append(item)
            excluded.append(f"{item.nodeid}  # excluded: {reason}")
            continue
        needed = next((n for k, n in sel.NEEDS_DEVICES.items() if _matches(item.nodeid, k)), 0)
        if needed:
            import jax

            have = jax.device_count()
            if have < needed:
                item.add_marker(pytest.mark.skip(
                    reason=f"needs {needed} devices, {jax.default_backend()} has {have}"))
        keep.append(item)
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = keep
    return excluded + [f"# stale key of tests/accelerator_selection.py, no such test: {key}"
                       for key in stale]


_recorder: Recorder | None = None
_excluded: list[str] = []


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    global _excluded
    if os.environ.get("QURL_ACCELERATOR_SELECT") == "1":
        _excluded = _apply_selection(config, items)


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """selection.txt, from the single process or the first worker (all collect the same)."""
    out = os.environ.get("QURL_ACCELERATOR_OUT")
    worker = getattr(session.config, "workerinput", {}).get("workerid", "gw0")
    if out and worker == "gw0":
        lines = [item.nodeid for item in session.items] + _excluded
        Path(out, "selection.txt").write_text("\n".join(lines) + "\n")


def pytest_configure(config: pytest.Config) -> None:
    global _recorder
    out = os.environ.get("QURL_ACCELERATOR_OUT")
    if out and not _is_worker(config):
        _recorder = Recorder(Path(out), json.loads(os.environ.get("QURL_ACCELERATOR_INFO", "{}")))


def pytest_runtest_setup(item: pytest.Item) -> None:
    deadline = float(os.environ.get("QURL_ACCELERATOR_DEADLINE", "inf"))
    if time.time() > deadline:
        pytest.skip("the runner's time budget was spent before this test started (--budget)")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _recorder is not None and (result := _result_of(report)) is not None:
        _recorder.add(result)


def pytest_collectreport(report: pytest.CollectReport) -> None:
    """A file that fails to import (a missing package, say) is one error line, not a silence."""
    if _recorder is not None and report.failed:
        text = str(report.longrepr)
        _recorder.add(Result(report.nodeid, "error", 0.0,
                             "collection: " + " ".join(text.strip().splitlines()[-1:]), text))


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if _recorder is not None and not _is_worker(session.config):
        line = _recorder.finish(int(exitstatus))
        out = _recorder.out
        print(f"\n{line}\naccelerator results: {out / 'summary.txt'}, {out / 'junit.xml'}")
