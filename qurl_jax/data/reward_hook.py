"""Your own reward: a Python function that scores responses, run in the verifier's worker processes.

A reward function takes the responses and their reference answers (the data file's answer field,
as strings) and returns one float per response:

    def score(responses: list[str], answers: list[str]) -> list[float]: ...
    def score(responses, answers, prompts) -> list[float]: ...   # also the prompts

A function with a parameter named `prompts` also gets the problems (the data file's prompt field,
without the prompt suffix or chat template). It is named in the config as `reward.function =
"module.path:name"` (an importable module) or `"path/to/file.py:name"` (a file; a relative path
is read from the working directory, else from the repository), or handed to `Trainer(config,
workdir, reward_fn=fn)` from Python.

`load` checks a spec before anything runs (the module imports, the name exists, is callable and
takes (responses, answers[, prompts])), raising `ConfigError` in one line. `hook_computer` wraps
the function in a `RewardComputer`: each response is scored in a verifier worker process by a call
with lists of one element, under `reward.timeout_s`; a call that raises, returns something other
than one finite number, runs too long or kills its worker scores 0 and is counted in the
verifier's statistics (the first failure is logged with its response), and the run goes on, unless
every call of a batch raised or killed its worker: then the run stops with one line naming the first
(`qurl_jax.data.rewards.ALL_FAILED`). A Python function that worker processes cannot import
(a lambda, a closure, one defined in `__main__`) runs in threads of the trainer's process instead,
with the same error accounting but no time limit.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import inspect
import math
import os
import pickle
import sys
from collections.abc import Callable, Sequence
from typing import Any

from absl import logging

from qurl_jax.data.rewards import RewardComputer
from qurl_jax.runtime.errors import ConfigError
from qurl_jax.runtime.paths import data_path

FIELD = "config.reward.function"
SIGNATURE = "(responses: list[str], answers: list[str][, prompts: list[str]]) -> list[float]"

# file path -> its module, per process (a worker loads a file once).
_FILE_MODULES: dict[str, Any] = {}


def _file_path(path: str) -> str:
    """A reward file's absolute path: relative to the working directory, else to the repository."""
    return os.path.abspath(data_path(path))


def _is_file(module: str) -> bool:
    return module.endswith(".py") or os.sep in module or "/" in module


def resolve(spec: str) -> str:
    """The spec with a file's path made absolute (what worker processes load)."""
    module, sep, name = spec.rpartition(":")
    if sep and _is_file(module):
        return f"{_file_path(module)}:{name}"
    return spec


def _import_file(path: str, what: str) -> Any:
    if path in _FILE_MODULES:
        return _FILE_MODULES[path]
    if not os.path.isfile(path):
        raise ConfigError(f"{what}: no such file {path}")
    name = "qurl_jax_reward_" + str(abs(hash(path)))
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ConfigError(f"{what}: {path} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses and pickling look their module up here
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise ConfigError(f"{what}: importing {path} failed: {type(e).__name__}: {e}") from e
    _FILE_MODULES[path] = module
    return module


def _import(module: str, what: str) -> Any:
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as e:
        raise ConfigError(f"{what}: no module named {e.name!r}") from e
    except Exception as e:
        raise ConfigError(f"{what}: importing {module} failed: {type(e).__name__}: {e}") from e


def takes_prompts(fn: Callable[..., Any], what: str) -> bool:
    """Whether `fn` wants the prompts too (a parameter named `prompts`); `ConfigError` when it
    cannot be called as a reward function."""
    if not callable(fn):
        raise ConfigError(f"{what}: {type(fn).__name__} object is not callable; a reward "
                          f"function is {SIGNATURE}")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a signature: trust it
        return False
    wants = "prompts" in signature.parameters
    try:
        if wants:
            signature.bind([], [], prompts=[])
        else:
            signature.bind([], [])
    except TypeError as e:
        raise ConfigError(f"{what}: {getattr(fn, '__name__', fn)}{signature} cannot be called as "
                          f"{SIGNATURE} ({e})") from None
    return wants


def load(spec: str, what: str = FIELD) -> Callable[..., Any]:
    """The function a spec names ("module.path:name" or "path/to/file.py:name"), checked;
    `ConfigError` naming `what` otherwise."""
    module, sep, name = spec.rpartition(":")
    if not sep or not module or not name:
        raise ConfigError(f"{what}={spec!r} must be 'module.path:name' or "
                          "'path/to/file.py:name'")
    imported = _import_file(_file_path(module), what) if _is_file(module) else \
        _import(module, what)
    target: Any = imported
    for part in name.split("."):
        if not hasattr(target, part):
            raise ConfigError(f"{what}={spec!r}: {module} has no attribute {name!r}")
        target = getattr(target, part)
    takes_prompts(target, f"{what}={spec!r}")
    return target


@functools.cache
def _loaded(spec: str) -> tuple[Callable[..., Any], bool]:
    fn = load(spec)
    return fn, takes_prompts(fn, FIELD)


def score_one(target: str | Callable[..., Any], response: str, item: tuple[str, str]) -> float:
    """One response's reward: `target` (a resolved spec, or a function) called with lists of one
    element; `item` is (answer, prompt). Raises when the function does not return one number."""
    if isinstance(target, str):
        fn, wants = _loaded(target)
    else:
        fn, wants = target, takes_prompts(target, "reward_fn")
    answer, prompt = item
    out = fn([response], [answer], prompts=[prompt]) if wants else fn([response], [answer])
    if isinstance(out, int | float) and not isinstance(out, bool):
        values: Sequence[Any] = [out]
    else:
        try:
            values = list(out)
        except TypeError:
            raise ValueError(f"bad reward function: it returned {type(out).__name__}, not one "
                             "float per response") from None
    if len(values) != 1:
        raise ValueError(f"bad reward function: it returned {len(values)} values for 1 response "
                         "(one float per response)")
    try:
        value = float(values[0])
    except (TypeError, ValueError):
        raise ValueError(f"bad reward function: it returned {values[0]!r}, not a float") from None
    if not math.isfinite(value):
        raise ValueError(f"bad reward function: it returned {value}")
    return value


def answer_and_prompt(example: Any) -> tuple[str, str]:
    """What a hook's `RewardComputer` gets as the "answer" of one example: (answer, prompt)."""
    return example.answer, example.problem


def _importable(fn: Callable[..., Any]) -> bool:
    """Whether a worker process can import `fn` by reference."""
    if getattr(fn, "__module__", None) in (None, "__main__"):
        return False
    try:
        pickle.dumps(fn)
    except Exception:  # noqa: BLE001 - any pickling failure means "not importable"
        return False
    return True


def hook_computer(fn_or_spec: str | Callable[..., Any], *, workers: int, timeout_s: float
                  ) -> RewardComputer:
    """A `RewardComputer` that scores (response, (answer, prompt)) pairs with a user's function:
    in `workers` verifier processes under `timeout_s` each, or (a function they cannot import)
    in threads with a warning."""
    if isinstance(fn_or_spec, str):
        load(fn_or_spec)  # checked here, and again (cached) in each worker
        target: str | Callable[..., Any] = resolve(fn_or_spec)
    else:
        takes_prompts(fn_or_spec, "reward_fn")
        target = fn_or_spec
    item = functools.partial(score_one, target)
    if isinstance(target, str) or _importable(target):
        # The workers import this module, not math_verify, before their first call.
        return RewardComputer(item, num_workers=workers, timeout_s=timeout_s,
                              preload=(__name__,), stop_if_all_fail=True)
    logging.warning("reward_fn %s cannot be imported by the verifier processes (a lambda, a "
                    "closure or a function of __main__): it runs in threads, without the "
                    "%.3g s time limit; define it in a module to run it under the limit",
                    getattr(target, "__qualname__", target), timeout_s)
    return RewardComputer(item, num_workers=workers, use_processes=False, stop_if_all_fail=True)
