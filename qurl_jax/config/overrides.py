"""Command-line overrides of list fields as comma-separated values.

`ml_collections` reads a tuple field's override as a Python literal (`--config.data.train_files=
"('/a.jsonl', '/b.jsonl')"`) and refuses `/a.jsonl,/b.jsonl`. `expand_lists` rewrites the
`--config.<field>=a,b` arguments of the tuple fields of `config.base_config()` (which every config
file starts from) into that literal before the flags are parsed: elements that read as Python
numbers or booleans become them, the others stay strings; an empty value is the empty tuple. A
value that already starts with '(' or '[' is left to `ml_collections` as it is.
"""

from __future__ import annotations

import ast
from collections.abc import Sequence

from qurl_jax.config.base import base_config

# Fields that were renamed: the old dotted name and the line that says what to write instead.
RENAMED = {"eval.greedy": "it is eval.greedy_only now (True: greedy accuracy only; greedy "
                          "accuracy is always reported)"}


def tuple_fields() -> set[str]:
    """Dotted names of the tuple fields of `base_config()`."""
    out: set[str] = set()

    def walk(section, prefix: str) -> None:
        for key, value in section.items():
            if hasattr(value, "items"):
                walk(value, f"{prefix}{key}.")
            elif isinstance(value, tuple):
                out.add(prefix + key)

    walk(base_config(), "")
    return out


def _element(text: str) -> object:
    text = text.strip()
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text
    return value if isinstance(value, int | float | bool) else text


def expand_lists(argv: Sequence[str]) -> list[str]:
    """`argv` with `--config.<tuple field>=a,b,c` rewritten as a tuple literal."""
    fields = tuple_fields()
    out = []
    for arg in argv:
        name, sep, value = arg.partition("=")
        if sep and name.startswith("--config.") and name[len("--config."):] in fields \
                and not value.lstrip().startswith(("(", "[")):
            parts = [p for p in value.split(",") if p.strip()]
            arg = f"{name}={tuple(_element(p) for p in parts)!r}"
        out.append(arg)
    return out


def flag_error(argv: Sequence[str], text: str) -> str:
    """The one-line message of a flag `ml_collections` or absl refused: an unknown field named
    by its full path (`--config.rollout.presicion: no such field 'presicion' ...`, where they name
    the leaf only) and its suggestion as a sentence of its own ("... no such field 'presicion'.
    Did you mean ..."), and without absl's leading "flag " (the line already says "bad flag")."""
    text = " ".join(text.split())
    if text.startswith("flag --"):
        text = text[len("flag "):]
    if text.startswith("'"):  # an unknown field: "'leaf' Did you mean ...?" or "'leaf'"
        leaf, _, rest = text[1:].partition("'")
        rest = f". {rest.strip()}" if rest.strip() else ""  # two sentences, not run together
        for arg in argv:
            name = arg.split("=", 1)[0]
            if name.startswith("--config.") and leaf in name.split(".")[1:]:
                renamed = RENAMED.get(name[len("--config."):])
                rest = f". {renamed[0].upper()}{renamed[1:]}" if renamed and not rest else rest
                return f"{name}: no such field '{leaf}'{rest}"
    return text
