"""The errors a user can fix from the message alone: `python -m qurl_jax.main` reports each in one
line naming the field, file or path (`qurl_jax: <what>: <message>`) and exits with code 2; any
other exception is a bug and keeps its traceback. `--verbose` shows the traceback of these too.

Each is also a `ValueError`, so code that caught the `ValueError`s these replace still catches them.
"""

from __future__ import annotations


class UserError(ValueError):
    """Bad input: a config value, a file, a path or a mesh that does not fit the machine."""

    what = "error"  # the word after "qurl_jax: " on the reported line


class ConfigError(UserError):
    """A config field's value (the message starts with `config.<field>`)."""

    what = "bad config"


class DataError(UserError):
    """A data file that cannot be read or holds no usable example (the message names it)."""

    what = "bad data"


class WorkdirError(UserError):
    """A workdir that cannot be created or written."""

    what = "bad workdir"


class MeshError(UserError):
    """A mesh that does not fit the devices or processes of the run."""

    what = "bad mesh"


class RewardError(UserError):
    """A reward function that failed on every call of a batch (the message names the first
    failure and the response that caused it)."""

    what = "bad reward function"


class FlagError(UserError):
    """A command-line flag other than a config field (`--num_processes`, ...)."""

    what = "bad flag"
