"""Docs that must stay true to the code: `--print_config` prints every field's whole doc, the
accelerator page lists every selected test file and the Pallas kernels the project runs, the
README's headline accuracies carry their conditions, its suite time is docs/testing.md's, and the
verifier's workers are documented as what they are (processes)."""

import re
from pathlib import Path

import pytest

from qurl_jax.config.base import base_config, field_docs, format_config

ROOT = Path(__file__).resolve().parents[1]
# e.g. a Bazel sandbox without the documentation in its data
needs_docs = pytest.mark.skipif(not (ROOT / "README.md").exists(), reason="no docs in this tree")


def _printed_docs(text: str) -> dict[str, str]:
    """field -> its doc as printed (the first line's `# ...` and its `    # ...` continuations)."""
    out: dict[str, str] = {}
    name = None
    for line in text.splitlines():
        if line.startswith("    # ") and name:  # the doc goes on (or starts below a long value)
            out[name] = f"{out[name]} {line[6:]}" if out[name] else line[6:]
        else:
            name = line.split(" = ", 1)[0]
            out[name] = line.split("  # ", 1)[1] if "  # " in line else ""
    return out


def test_print_config_shows_every_doc_whole():
    docs = field_docs()
    text = format_config(base_config())
    assert all(len(line) <= 100 for line in text.splitlines())
    printed = _printed_docs(text)
    whole = {name: doc for name, doc in docs.items() if name in printed}
    assert len(whole) > 50
    for name, doc in whole.items():
        assert printed[name] == " ".join(doc.split()), name


@needs_docs
def test_accelerator_page_lists_every_selected_file_and_the_pallas_kernels():
    from tests.accelerator_selection import FILES

    page = (ROOT / "docs" / "accelerators.md").read_text()
    table = {m for m in re.findall(r"^\| `(test_\w+\.py)` \|", page, re.M)}
    assert table == {Path(f).name for f in FILES}
    assert "the project has none" not in page
    assert "pallas.ops.gpu.decode_attention" in page and "pallas.ops.tpu.paged_attention" in page


@needs_docs
def test_readme_figures_carry_their_conditions():
    readme = " ".join((ROOT / "README.md").read_text().split())
    study = " ".join((ROOT / "docs" / "study.md").read_text().split())
    # The default set-up's figures (AVX512) first, with their machine; the AVX2 run's second.
    headline = re.search(r"raises sampled accuracy \(Avg@4\) from ([\d.]+)% to ([\d.]+)%, the "
                         r"INT8 rollout at ([\d.]+(?:-[\d.]+)?)x the FP32 one \(([^)]*)\)", readme)
    assert headline, "the README's headline sentence moved"
    before, after, speed, conditions = headline.groups()
    assert "AVX512" in conditions and "seed 0" in conditions and "default set-up" in conditions
    assert f"Avg@4 {before}% -> {after}%, the INT8 rollout at {speed}x" in study
    second = re.search(r"On an AVX2 machine with the CPU kernels off the same command gave "
                       r"([\d.]+)% -> ([\d.]+)% and ([\d.]+)x", readme)
    assert second, "the README's second (AVX2) line moved"
    measured = re.search(r"Measured [\d-]+ \(seed 0, AVX2 machine, CPU kernels off\):.*?"
                         r"\| Avg@4 \(sampled, T = 1\) \| ([\d.]+)% \| ([\d.]+)% \|", study)
    assert measured and measured.groups() == second.groups()[:2]
    assert f"INT8 rollout runs at {second[3]}x the FP32 rollout here" in study
    suite = re.search(r"default suite \(([\d.]+)(?:-([\d.]+))? min", readme)  # a figure or a range
    testing = " ".join((ROOT / "docs" / "testing.md").read_text().split())
    assert suite
    figure = f"{suite[1]} to {suite[2]}" if suite[2] else suite[1]
    assert f"in {figure} minutes" in testing


def test_reward_workers_are_documented_as_processes():
    doc = field_docs()["reward.workers"]
    assert "process" in doc and "thread" not in doc
