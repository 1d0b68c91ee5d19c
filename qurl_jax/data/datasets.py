"""Math problem sets: tolerant loaders, the prompt template and a resumable prompt iterator.

`load_math_file` reads a JSON array, JSON Lines or parquet file and detects the row layout: plain /
DeepScaleR rows (`problem`, `answer`, maybe `solution`), DAPO-Math-17k rows (`prompt` as a chat list
of {role, content} plus `reward_model.ground_truth`) or GSM8K rows (`question`, answer after
`####`), or, given `keys` (`data.prompt_key`, `data.answer_key`), any rows through those two
fields. Bad rows (missing or non-string problem, missing or unusable answer, broken JSON line) are
skipped and counted by reason in `LoadStats`, never raised; numeric answers become strings (`142.0`
-> `"142"`) and list answers are either alternatives (default; the Minerva file lists equivalent
forms of one answer) or comma-joined parts. `PromptIterator` yields shuffled batches epoch after
epoch from a seed and exposes its position as a small JSON-serialisable dict, so a checkpoint
resumes the data stream exactly.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from qurl_jax.runtime import paths

# The math task's default `data.prompt_suffix`, appended to every problem.
PROMPT_SUFFIX = " Let's think step by step and output the final answer within \\boxed{}."
PROMPT_TEMPLATE = "{problem}" + PROMPT_SUFFIX

# Default location of the bundled evaluation and training sets (see its README for row counts).
MATH_DATA_DIR = Path(__file__).resolve().parents[2] / "third_party" / "math_data"

# Evaluation sets of the QuRL DeepScaleR table -> file in MATH_DATA_DIR.
MATH_EVAL_SETS: dict[str, str] = {
    "aime24": "test_aime.json",
    "amc": "test_amc.json",
    "math500": "test_math.json",
    "minerva": "test_minerva.json",
    "olympiad_bench": "test_olympiad_bench.json",
}

ListAnswerMode = Literal["alternatives", "join"]

# DAPO-Math-17k wraps every problem in a fixed instruction; we strip it and apply our own template.
_DAPO_PREFIX = re.compile(r"^\s*Solve the following math problem step by step\..*?\n\n", re.DOTALL)
_DAPO_SUFFIX = re.compile(r"\n\nRemember to put your answer on its own line after .*$", re.DOTALL)
_GSM8K_ANSWER = re.compile(r"####\s*(.+?)\s*$", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class MathExample:
    """One problem with its reference answer.

    Attributes:
      problem: the problem text (no template applied).
      answer: the reference answer as a string (LaTeX or plain).
      source: the data set name (by default the file stem, e.g. "test_aime").
      index: the row number in the source file (0-based, counting skipped rows).
      alternatives: further accepted forms of the same answer (from list-valued answers).
    """

    problem: str
    answer: str
    source: str
    index: int
    alternatives: tuple[str, ...] = ()

    @property
    def gold_answers(self) -> tuple[str, ...]:
        """All accepted answers: `answer` first, then `alternatives`."""
        return (self.answer, *self.alternatives)


def gold_answers(example: MathExample) -> tuple[str, ...]:
    """`example.gold_answers`: what a verifier gets as the example's answer."""
    return example.gold_answers


@dataclasses.dataclass
class LoadStats:
    """What `load_math_file` read and skipped.

    Attributes:
      path: the file read.
      layout: detected row layout ("problem_answer", "dapo", "gsm8k", "keys" when read through
        named fields, or "mixed:<a>+<b>").
      total_rows: rows in the file (for JSONL, non-blank lines).
      loaded: rows turned into examples.
      skipped: reason -> count of rows dropped.
      skipped_rows: (row index, reason) of the first `_MAX_SKIPPED_ROWS` dropped rows.
      normalised_answers: non-string answers converted to strings.
    """

    path: str
    layout: str = "empty"
    total_rows: int = 0
    loaded: int = 0
    skipped: dict[str, int] = dataclasses.field(default_factory=dict)
    skipped_rows: list[tuple[int, str]] = dataclasses.field(default_factory=list)
    normalised_answers: int = 0

    @property
    def num_skipped(self) -> int:
        """Total number of dropped rows."""
        return sum(self.skipped.values())


_MAX_SKIPPED_ROWS = 20


# Stands in for a JSON Lines line that does not parse, so it is counted like any other bad row.
_BROKEN_LINE = object()


class _SkipRow(Exception):
    """A row cannot be used; the message is the reason counted in `LoadStats.skipped`."""


def _scalar_answer(value: Any) -> str:
    """A number or string answer as a stripped string; ints without '.0', floats positional."""
    if isinstance(value, bool):
        raise _SkipRow("unsupported answer type bool")
    if isinstance(value, str):
        return value.strip()
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _SkipRow("non-finite answer")
        if value.is_integer():
            return str(int(value))
        return np.format_float_positional(value, trim="-")
    raise _SkipRow(f"unsupported answer type {type(value).__name__}")


def normalise_answer(
    value: Any, list_answers: ListAnswerMode = "alternatives"
) -> tuple[str, tuple[str, ...]]:
    """Converts a raw answer field to `(answer, alternatives)`.

    Args:
      value: a string, int, float or a list/tuple of those.
      list_answers: for lists, "alternatives" keeps the first distinct element as the answer and
        the others as accepted alternatives; "join" joins the elements with ", " into one answer.

    Returns:
      The answer string and a (possibly empty) tuple of alternatives.

    Raises:
      _SkipRow: when the value is missing, empty or of an unusable type (reason in the message).
    """
    if value is None:
        raise _SkipRow("missing answer")
    if isinstance(value, (list, tuple)):
        parts = [_scalar_answer(v) for v in value]
        parts = list(dict.fromkeys(p for p in parts if p))
        if not parts:
            raise _SkipRow("empty answer")
        if list_answers == "join":
            return ", ".join(parts), ()
        return parts[0], tuple(parts[1:])
    answer = _scalar_answer(value)
    if not answer:
        raise _SkipRow("empty answer")
    return answer, ()


def _row_layout(row: dict[str, Any]) -> str:
    if "problem" in row:
        return "problem_answer"
    if "prompt" in row and "reward_model" in row:
        return "dapo"
    if "question" in row:
        return "gsm8k"
    return "unknown"


def _problem_text(value: Any, field: str) -> str:
    if value is None:
        raise _SkipRow(f"missing {field}")
    if not isinstance(value, str):
        raise _SkipRow(f"non-string {field}")
    if not value.strip():
        raise _SkipRow(f"empty {field}")
    return value


def _dapo_problem(prompt: Any) -> str:
    """The user turn of a DAPO chat prompt, without DAPO's fixed instruction wrapper."""
    if isinstance(prompt, str):
        return _problem_text(prompt, "prompt")
    if not isinstance(prompt, (list, tuple)):
        raise _SkipRow("non-list prompt")
    user_turns = [
        m.get("content") for m in prompt if isinstance(m, dict) and m.get("role") == "user"
    ]
    if not user_turns:
        raise _SkipRow("prompt without user message")
    text = _problem_text(user_turns[-1], "prompt content")
    text = _DAPO_SUFFIX.sub("", _DAPO_PREFIX.sub("", text, count=1), count=1)
    return _problem_text(text, "prompt content")


def _field(row: dict[str, Any], key: str) -> Any:
    """`row[key]`, a dotted key read through nested objects; None when missing."""
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict):
            return None
        value = value.get(part)
    return value


def _keyed_row(row: dict[str, Any], keys: tuple[str, str], list_answers: ListAnswerMode
               ) -> tuple[str, str, str, tuple[str, ...], bool]:
    """A row read through its named prompt and answer fields; a chat-list prompt gives its last
    user turn, an object answer its JSON text."""
    prompt_key, answer_key = keys
    prompt = _field(row, prompt_key)
    if isinstance(prompt, list | tuple):
        turns = [m.get("content") for m in prompt if isinstance(m, dict)
                 and m.get("role") == "user"]
        prompt = turns[-1] if turns else None
    problem = _problem_text(prompt, prompt_key)
    raw_answer = _field(row, answer_key)
    if raw_answer is None:
        raise _SkipRow(f"missing {answer_key}")
    if isinstance(raw_answer, dict):
        raw_answer = json.dumps(raw_answer, sort_keys=True)
    answer, alternatives = normalise_answer(raw_answer, list_answers)
    return "keys", problem, answer, alternatives, not isinstance(raw_answer, str)


def _parse_row(
    row: Any, list_answers: ListAnswerMode, keys: tuple[str, str] | None = None
) -> tuple[str, str, str, tuple[str, ...], bool]:
    """Returns (layout, problem, answer, alternatives, answer_was_normalised) or raises _SkipRow.
    With `keys` (prompt field, answer field) the row is read through them, else by its layout."""
    if not isinstance(row, dict):
        raise _SkipRow("row is not an object")
    if keys is not None:
        return _keyed_row(row, keys, list_answers)
    layout = _row_layout(row)
    if layout == "problem_answer":
        problem = _problem_text(row.get("problem"), "problem")
        raw_answer = row.get("answer")
    elif layout == "dapo":
        problem = _dapo_problem(row.get("prompt"))
        reward_model = row.get("reward_model")
        if not isinstance(reward_model, dict):
            raise _SkipRow("reward_model is not an object")
        raw_answer = reward_model.get("ground_truth")
    elif layout == "gsm8k":
        problem = _problem_text(row.get("question"), "question")
        raw_answer = row.get("answer")
        if isinstance(raw_answer, str):
            match = _GSM8K_ANSWER.search(raw_answer)
            if match is None:
                raise _SkipRow("gsm8k answer without ####")
            raw_answer = match.group(1).replace(",", "")
    else:
        raise _SkipRow("missing problem")
    answer, alternatives = normalise_answer(raw_answer, list_answers)
    return layout, problem, answer, alternatives, not isinstance(raw_answer, str)


def _read_rows(path: str) -> list[Any]:
    """Raw rows of a JSON array, JSONL or parquet file (a local path or a URL); a broken JSONL line
    becomes _BROKEN_LINE."""
    suffix = os.path.splitext(path)[1].lower()
    if suffix == ".parquet":
        import pyarrow.parquet as pq

        with paths.open_file(path, "rb") as f:
            return pq.read_table(f).to_pylist()
    if suffix not in (".json", ".jsonl"):
        raise ValueError(f"unsupported math data file type {suffix!r}: {path}")
    with paths.open_file(path, "rb") as f:
        text = f.read().decode("utf-8")
    if suffix == ".json" and text.lstrip().startswith("["):
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"invalid JSON array in math data file {path}: {e}") from e
        return rows
    # JSON Lines (also accepted under a .json name when the file is not an array).
    rows: list[Any] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            rows.append(_BROKEN_LINE)
    return rows



def load_math_file(
    path: str | Path,
    source: str | None = None,
    list_answers: ListAnswerMode = "alternatives",
    keys: tuple[str, str] | None = None,
) -> tuple[list[MathExample], LoadStats]:
    """Loads math problems from a JSON array, JSONL or parquet file, skipping unusable rows.

    Args:
      path: a `.json` (array, or JSON Lines), `.jsonl` or `.parquet` file; a local path or a URL
        (gs://, through fsspec).
      source: name stored in each example; defaults to the file stem.
      list_answers: how list-valued answers are read (see `normalise_answer`).
      keys: (prompt field, answer field) of every row (`data.prompt_key`, `data.answer_key`; a
        dotted name reads a nested field); None detects the layout row by row.

    Returns:
      The examples in file order and the load statistics.

    Raises:
      FileNotFoundError: the file does not exist (the message names it).
      ValueError: the file type is unsupported or a JSON array file is not valid JSON.
    """
    path = os.fspath(path)
    if not paths.isfile(path):
        raise FileNotFoundError(f"math data file not found: {path}")
    stats = LoadStats(path=path)
    rows = _read_rows(path)
    if not isinstance(rows, list):
        raise ValueError(f"math data file {path} holds a JSON {type(rows).__name__}, not an array")
    source = os.path.splitext(paths.basename(path))[0] if source is None else source
    layouts: Counter[str] = Counter()
    examples: list[MathExample] = []
    skipped: Counter[str] = Counter()
    for index, row in enumerate(rows):
        try:
            if row is _BROKEN_LINE:
                raise _SkipRow("invalid JSON line")
            layout, problem, answer, alternatives, normalised = _parse_row(row, list_answers,
                                                                           keys)
        except _SkipRow as e:
            skipped[str(e)] += 1
            if len(stats.skipped_rows) < _MAX_SKIPPED_ROWS:
                stats.skipped_rows.append((index, str(e)))
            continue
        layouts[layout] += 1
        stats.normalised_answers += int(normalised)
        examples.append(MathExample(problem, answer, source, index, alternatives))
    stats.total_rows = len(rows)
    stats.loaded = len(examples)
    stats.skipped = dict(skipped)
    if layouts:
        names = [name for name, _ in layouts.most_common()]
        stats.layout = names[0] if len(names) == 1 else "mixed:" + "+".join(names)
    return examples, stats


def build_prompt(
    problem: str,
    tokenizer: Any = None,
    chat: bool = True,
    template: str = PROMPT_TEMPLATE,
) -> str:
    """The prompt string for one problem.

    `template`'s `{problem}` is replaced by the problem (plain substitution: the template's literal
    `\\boxed{}` is not a format field). With `chat` and a tokenizer that has a chat template, the
    text becomes a single user turn rendered with `add_generation_prompt=True`, so the string
    already holds the tokenizer's special tokens; encode it without adding special tokens again.

    Args:
      problem: the problem text.
      tokenizer: a Hugging Face tokenizer or None.
      chat: apply the tokenizer's chat template when it has one.
      template: the instruction template with a `{problem}` slot.
    """
    text = template.replace("{problem}", problem)
    if chat and tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
    return text


class PromptIterator:
    """An endless stream of shuffled example batches with a resumable position.

    Epoch `e` visits the examples in the order `np.random.default_rng([seed, e]).permutation(n)`
    (or file order without `shuffle`); a batch that reaches the end of an epoch continues with the
    next epoch's order, so every batch is full. `state()` returns the position as a dict of ints and
    `restore(state)` continues with exactly the batches an uninterrupted iterator would give.
    """

    def __init__(
        self,
        examples: Sequence[MathExample],
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
    ) -> None:
        """Args: examples (non-empty), batch_size (> 0) prompts per batch, seed, shuffle."""
        if not examples:
            raise ValueError("PromptIterator: examples is empty")
        if batch_size <= 0:
            raise ValueError(f"PromptIterator: batch_size must be positive, got {batch_size}")
        self.examples = list(examples)
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self._epoch = 0
        self._position = 0
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        n = len(self.examples)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    @property
    def epoch(self) -> int:
        """Number of completed passes over the examples."""
        return self._epoch

    def __iter__(self) -> PromptIterator:
        return self

    def __next__(self) -> list[MathExample]:
        """The next `batch_size` examples."""
        batch: list[MathExample] = []
        while len(batch) < self.batch_size:
            if self._position == len(self._order):
                self._epoch += 1
                self._position = 0
                self._order = self._epoch_order(self._epoch)
            take = min(self.batch_size - len(batch), len(self._order) - self._position)
            idx = self._order[self._position : self._position + take]
            batch.extend(self.examples[i] for i in idx)
            self._position += take
        return batch

    def state(self) -> dict[str, int]:
        """The position as JSON-serialisable ints (epoch, position, seed, sizes, shuffle)."""
        return {
            "epoch": self._epoch,
            "position": self._position,
            "seed": self.seed,
            "num_examples": len(self.examples),
            "batch_size": self.batch_size,
            "shuffle": int(self.shuffle),
        }

    def restore(self, state: dict[str, int]) -> None:
        """Continues from a `state()` taken on an iterator over the same examples and settings.

        Raises:
          ValueError: a field of `state` is missing or disagrees with this iterator (names it).
        """
        expected = {
            "seed": self.seed,
            "num_examples": len(self.examples),
            "batch_size": self.batch_size,
            "shuffle": int(self.shuffle),
        }
        for field in ("epoch", "position", *expected):
            if field not in state:
                raise ValueError(f"PromptIterator.restore: state lacks field {field!r}")
        for field, value in expected.items():
            if int(state[field]) != value:
                raise ValueError(
                    f"PromptIterator.restore: state field {field!r} is {state[field]}, "
                    f"this iterator has {value}"
                )
        position = int(state["position"])
        if not 0 <= position <= len(self.examples):
            raise ValueError(
                f"PromptIterator.restore: state field 'position' out of range: {position}"
            )
        self._epoch = int(state["epoch"])
        self._position = position
        self._order = self._epoch_order(self._epoch)
