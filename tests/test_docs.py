"""The documentation stays a short front door plus pages whose links resolve inside the repository.

README.md is at most 200 lines; every relative link (and image) in README.md, docs/**/*.md and
launch/README.md names a file or directory of the repository; nothing there points at a `shared`
directory beside the repository, which a user's clone does not have.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

# realpath: from Bazel's runfiles this is the source tree the test file links to.
ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
MAX_README_LINES = 200

if not README.exists():  # e.g. a Bazel sandbox without the documentation in its data
    pytest.skip("README.md is not in this tree", allow_module_level=True)

# [text](target) and ![alt](target); the target ends at whitespace or the closing parenthesis.
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
# Reference-style definitions: [label]: target
_REF = re.compile(r"^\s*\[[^\]]+\]:\s*(\S+)", re.MULTILINE)


def _pages() -> list[Path]:
    pages = [README, ROOT / "launch" / "README.md"]
    pages += sorted((ROOT / "docs").rglob("*.md"))
    return [p for p in pages if p.is_file()]


def _without_code(text: str) -> str:
    """The text without fenced code blocks and inline code, where brackets are not links."""
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    return re.sub(r"`[^`\n]*`", "", text)


def _relative_targets(text: str) -> list[str]:
    body = _without_code(text)
    targets = _LINK.findall(body) + _REF.findall(body)
    return [t for t in targets
            if not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:", t) and not t.startswith("#")]


def test_readme_is_a_short_front_door():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines"


def test_there_are_pages_to_check():
    names = {p.relative_to(ROOT).as_posix() for p in _pages()}
    assert {"README.md", "docs/methods.md"} <= names


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_relative_links_resolve_inside_the_repository(page: Path):
    broken = []
    for target in _relative_targets(page.read_text()):
        path = target.split("#", 1)[0]
        if not path:
            continue
        resolved = (page.parent / path).resolve()
        if not resolved.is_relative_to(ROOT) or not resolved.exists():
            broken.append(target)
    assert not broken, f"{page.relative_to(ROOT)}: links that do not resolve: {broken}"


@pytest.mark.parametrize("page", _pages(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_no_pointer_outside_the_repository(page: Path):
    text = page.read_text()
    found = [needle for needle in ("../shared", "shared/docs") if needle in text]
    assert not found, f"{page.relative_to(ROOT)} mentions {found}"


def test_link_pattern_finds_links_and_skips_code():
    text = ("see [methods](docs/methods.md#acr) and ![plot](docs/study/study.png)\n"
            "[web](https://example.com) [anchor](#x) `[not](a/link.md)`\n"
            "```\n[nor](this.md)\n```\n[ref]: docs/memory.md\n")
    assert _relative_targets(text) == ["docs/methods.md#acr", "docs/study/study.png",
                                       "docs/memory.md"]


def test_docs_pages_named_in_code_exist():
    """A docstring or comment that sends the reader to docs/... names a page that exists."""
    missing = set()
    for folder in ("qurl_jax", "configs", "tests", "launch"):
        for path in sorted((ROOT / folder).rglob("*")):
            if path.suffix not in (".py", ".sh", ".sbatch") or path.name == "test_docs.py":
                continue
            # a page of this repository, not a web address such as cloud.google.com/tpu/docs/v5p
            for name in re.findall(r"(?<![\w./-])docs/[\w./-]*\w", path.read_text()):
                if not (ROOT / name).exists():
                    missing.add(f"{path.relative_to(ROOT)}: {name}")
    assert not missing, sorted(missing)
