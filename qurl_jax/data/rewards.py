"""Verifiable rewards: math answers checked with math_verify, an exact match for arithmetic, format.

`math_reward` takes the last `\\boxed{...}` of a response and checks it for symbolic equivalence
with the reference answer (or any accepted alternative) using `math_verify`; 1.0 or 0.0. Sympy can
hang on adversarial answers (an exponent tower) inside C code that signals do not interrupt, and
`math_verify`'s signal timeout only works in a main thread, so every verification runs in a worker
subprocess with a hard wall-clock limit (`VerifierPool`, on pebble's process pool); a timed-out or
crashed check, or one for which no worker could be started, scores 0 and is counted.
`RewardComputer` scores a batch on a pool of such workers from a thread pool and returns a
`concurrent.futures.Future`, so the CPU-bound checking overlaps the accelerator's work.

A failing reward is never silent: the first call that raises (or returns a bad value), times out or
kills its worker is logged once with its exception and the response that caused it, and a batch in
which every call raised or killed its worker (`ALL_FAILED`: the function is broken, not one odd
response) ends the run with a `RewardError` naming that first failure.
"""

from __future__ import annotations

import atexit
import concurrent.futures
import os
import pickle
import threading
from collections.abc import Callable, Sequence

from absl import logging

from qurl_jax.data._process_pool import WORKER_ENV, VerifierPool
from qurl_jax.runtime.errors import RewardError

Answer = str | Sequence[str]
RewardFn = Callable[[str, Answer], float]

DEFAULT_TIMEOUT_S = 5.0
# What a verifier worker does before it takes work: math_verify's imports and first parse.
DEFAULT_PRELOAD = ("qurl_jax.data.rewards:warm_up_math_verify",)
# The failures that, when every call of a batch ends in one, stop the run (`RewardError`): the
# function raised or returned something other than one finite number, or killed its worker.
# Timeouts are counted and logged but never stop a run (a slow machine can time out every call).
ALL_FAILED = ("errors", "crashes")
_SHOWN_CHARS = 200  # of the response in the first failure's log line


def _shown(response: str) -> str:
    text = response if len(response) <= _SHOWN_CHARS else response[:_SHOWN_CHARS] + "..."
    return repr(text)


def _golds(answer: Answer) -> list[str]:
    return [answer] if isinstance(answer, str) else list(answer)


def _boxed_spans(text: str) -> list[str]:
    """Contents of every complete `\\boxed{...}` (nested braces matched), in order."""
    contents = []
    start = text.find("\\boxed")
    while start != -1:
        i = start + len("\\boxed")
        while i < len(text) and text[i] == " ":
            i += 1
        if i < len(text) and text[i] == "{":
            depth = 0
            for j in range(i, len(text)):
                depth += {"{": 1, "}": -1}.get(text[j], 0)
                if depth == 0:
                    contents.append(text[i + 1 : j])
                    break
        start = text.find("\\boxed", i)
    return contents


def last_boxed(text: str) -> str | None:
    """The content of the last complete `\\boxed{...}` in text, or None when there is none."""
    spans = _boxed_spans(text)
    return spans[-1] if spans else None


def format_reward(response: str) -> float:
    """1.0 when the response holds exactly one complete, non-empty `\\boxed{...}`, else 0.0."""
    spans = _boxed_spans(response)
    return 1.0 if len(spans) == 1 and spans[0].strip() else 0.0


def _gold_latex(gold: str) -> str:
    # Reference answers are sometimes wrapped in $...$ (OlympiadBench); boxing makes math_verify
    # take the whole answer rather than the first expression it finds.
    if "\\$" not in gold:
        gold = gold.replace("$", "")
    return "\\boxed{" + gold.strip() + "}"


def verify_math_answer(response: str, answer: Answer) -> float:
    """math_verify check of the response's last boxed answer, in this process, with NO time limit.

    Use `math_reward` (or a `RewardComputer`) on model output; this is what their workers run.

    Args:
      response: the generated text.
      answer: the reference answer, or several accepted forms of it.

    Returns:
      1.0 when the last `\\boxed{...}` is equivalent to a reference answer, else 0.0 (also when
      there is no boxed answer).
    """
    from math_verify import parse, verify

    boxed = last_boxed(response)
    if boxed is None or not boxed.strip():
        return 0.0
    predicted = parse("\\boxed{" + boxed + "}", parsing_timeout=None)
    if not predicted:
        return 0.0
    for gold in _golds(answer):
        parsed_gold = parse(_gold_latex(gold), parsing_timeout=None)
        if parsed_gold and verify(parsed_gold, predicted, timeout_seconds=None):
            return 1.0
    return 0.0


def warm_up_math_verify() -> None:
    """Runs a few typical verifications so that math_verify's and sympy's lazy imports and caches
    are ready (the first calls of a fresh process are several times slower than later ones)."""
    for response, answer in (
        ("\\boxed{\\frac{1}{2}}", "0.5"),
        ("\\boxed{x=2\\sqrt{2}}", "\\sqrt{8}"),
        ("\\boxed{[0, 1)}", "\\{1, 2\\}"),
        ("\\boxed{10^{\\circ}}", "\\text{(A)}"),
    ):
        verify_math_answer(response, answer)


_default_pool: VerifierPool | None = None
_default_pool_lock = threading.Lock()


def _shared_pool() -> VerifierPool:
    global _default_pool
    with _default_pool_lock:
        if _default_pool is None:
            _default_pool = VerifierPool(num_workers=1, timeout_s=DEFAULT_TIMEOUT_S)
            atexit.register(_default_pool.close)
        return _default_pool


def math_reward(response: str, answer: Answer, timeout_s: float = DEFAULT_TIMEOUT_S) -> float:
    """1.0 if the response's last `\\boxed{...}` is mathematically equal to the answer, else 0.0.

    Runs `verify_math_answer` in a shared worker subprocess (started on first use) and returns 0.0
    when it takes longer than `timeout_s` seconds; the hung worker is killed and replaced. Safe from
    any thread. Inside a verifier worker (e.g. when a `RewardComputer` runs this function) it
    verifies directly, since the worker is already under a hard limit.
    """
    if os.environ.get(WORKER_ENV):
        return verify_math_answer(response, answer)
    status, value = _shared_pool().call(verify_math_answer, response, answer, timeout_s=timeout_s)
    return float(value) if status == "ok" else 0.0


def math_format_reward(response: str, answer: Answer, format_weight: float = 0.1) -> float:
    """(1 - format_weight) * correctness + format_weight * `format_reward`, in [0, 1].

    Use `functools.partial(math_format_reward, format_weight=w)` to pick the weight; correctness is
    the 0/1 of `math_reward`.
    """
    return (1.0 - format_weight) * math_reward(response, answer) + format_weight * format_reward(
        response
    )


def exact_match_reward(response: str, answer: Answer) -> float:
    """1.0 when the final answer equals a reference string exactly (after stripping whitespace).

    The final answer is the last `\\boxed{...}` content when the response has one, else the whole
    response; "19" and "\\boxed{19}" match "19", "19.0" or "19 19" do not.
    """
    boxed = last_boxed(response)
    predicted = (response if boxed is None else boxed).strip()
    return 1.0 if any(predicted == gold.strip() for gold in _golds(answer)) else 0.0


class RewardComputer:
    """Scores batches of responses on a thread pool, optionally through verifier subprocesses.

    With `use_processes=True` each (response, answer) pair runs `reward_fn` in one of `num_workers`
    `VerifierPool` processes under a hard `timeout_s` limit; a timeout, an exception, a crash or a
    worker that could not be started scores `failure_reward` and is counted in `stats` (the pool
    keeps trying to restore its workers; the batch goes on). With `use_processes=False` the
    function runs in `num_workers` threads of this process with no time limit (for cheap
    pure-Python rewards such as `exact_match_reward`). `submit` returns a
    `concurrent.futures.Future[list[float]]` immediately; `__call__` waits for it. Batches
    submitted one after another complete in order.

    The first failure is logged once (`first_failure`: its kind, message and response); with
    `stop_if_all_fail` a batch in which every call failed as `ALL_FAILED` says raises
    `RewardError` from the future instead of returning rewards.
    """

    def __init__(
        self,
        reward_fn: RewardFn = math_reward,
        num_workers: int = 2,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        use_processes: bool = True,
        failure_reward: float = 0.0,
        memory_limit_mb: int | None = 4096,
        preload: Sequence[str] = DEFAULT_PRELOAD,
        stop_if_all_fail: bool = False,
    ) -> None:
        """Args: see the class docstring; `reward_fn(response, answer) -> float` must be picklable
        (a module-level function or a functools.partial of one) when `use_processes`; `preload`:
        what each worker process imports (or calls) before it takes work (`VerifierPool`)."""
        if num_workers <= 0:
            raise ValueError(f"RewardComputer: num_workers must be positive, got {num_workers}")
        if use_processes:
            try:
                pickle.dumps(reward_fn)
            except (pickle.PicklingError, AttributeError, TypeError) as e:
                raise ValueError(
                    "RewardComputer: reward_fn must be picklable (a module-level function) to run "
                    f"in verifier processes: {e}"
                ) from e
            if getattr(reward_fn, "__module__", None) == "__main__":
                raise ValueError(
                    "RewardComputer: reward_fn is defined in __main__, which verifier processes "
                    "cannot import; move it to a module"
                )
        self.reward_fn = reward_fn
        self.timeout_s = timeout_s
        self.failure_reward = failure_reward
        self._pool = (
            VerifierPool(num_workers, timeout_s, memory_limit_mb, preload) if use_processes
            else None
        )
        self._items = concurrent.futures.ThreadPoolExecutor(num_workers, "reward-item")
        self._batches = concurrent.futures.ThreadPoolExecutor(1, "reward-batch")
        self._stats_lock = threading.Lock()
        self._stats = {"calls": 0, "timeouts": 0, "errors": 0, "crashes": 0,
                       "worker_failures": 0}
        self.stop_if_all_fail = stop_if_all_fail
        self.first_failure: str | None = None  # "<kind>: <message> (response '...')"

    @property
    def stats(self) -> dict[str, int]:
        """Counts so far: calls, timeouts, errors (the function raised), crashes (worker died),
        worker_failures (no worker could be started for the call)."""
        with self._stats_lock:
            return dict(self._stats)

    def _count(self, key: str) -> None:
        with self._stats_lock:
            self._stats[key] += 1

    def _failed(self, key: str, message: str | None, response: str) -> tuple[str, str]:
        """Counts a failure of kind `key`; logs the first one (with its response) once."""
        self._count(key)
        what = {"errors": "raised or returned a bad value", "timeouts": "timed out",
                "crashes": "killed its worker", "worker_failures": "found no worker"}[key]
        line = f"{what}: {message or f'over {self.timeout_s:g} s'} (response {_shown(response)})"
        with self._stats_lock:
            first, self.first_failure = self.first_failure is None, self.first_failure or line
        if first:
            logging.warning("reward: the first failing call %s; it scores %g, and every failure "
                            "is counted in verifier/%s (this is logged once)", line,
                            self.failure_reward, key)
        return key, line

    def _score(self, response: str, answer: Answer) -> tuple[float, tuple[str, str] | None]:
        """(reward, None) or (failure_reward, (the kind of failure, what happened))."""
        self._count("calls")
        if self._pool is None:
            try:
                return float(self.reward_fn(response, answer)), None
            except Exception as e:  # noqa: BLE001 - a failing reward scores failure_reward
                return self.failure_reward, self._failed("errors", f"{type(e).__name__}: {e}",
                                                         response)
        status, value = self._pool.call(self.reward_fn, response, answer)
        if status == "ok":
            return float(value), None
        key = {"timeout": "timeouts", "error": "errors", "crash": "crashes",
               "unavailable": "worker_failures"}[status]
        return self.failure_reward, self._failed(key, value, response)

    def _score_batch(self, responses: list[str], answers: list[Answer]) -> list[float]:
        scored = list(self._items.map(self._score, responses, answers))
        if self.stop_if_all_fail and scored and all(f and f[0] in ALL_FAILED for _, f in scored):
            raise RewardError(
                f"every one of the {len(scored)} reward calls of this batch failed; the first "
                f"{scored[0][1][1]}. A reward function takes (responses, answers[, prompts]) "
                "and returns one float per response")
        return [value for value, _ in scored]

    def submit(
        self, responses: Sequence[str], answers: Sequence[Answer]
    ) -> concurrent.futures.Future[list[float]]:
        """Starts scoring; the future's result is one reward per response, in order.

        Args:
          responses: N generated texts.
          answers: N reference answers (a string or a sequence of accepted strings each); repeat a
            prompt's answer for each of its samples.
        """
        if len(responses) != len(answers):
            raise ValueError(
                f"RewardComputer: {len(responses)} responses but {len(answers)} answers"
            )
        return self._batches.submit(self._score_batch, list(responses), list(answers))

    def __call__(self, responses: Sequence[str], answers: Sequence[Answer]) -> list[float]:
        """Scores and waits: `submit(responses, answers).result()`."""
        return self.submit(responses, answers).result()

    def close(self) -> None:
        """Waits for submitted batches, then stops the threads and worker processes."""
        self._batches.shutdown(wait=True)
        self._items.shutdown(wait=True)
        if self._pool is not None:
            self._pool.close()

    def __enter__(self) -> RewardComputer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def compute_rewards(
    responses: Sequence[str],
    answers: Sequence[Answer],
    reward_fn: RewardFn = math_reward,
    num_workers: int = 2,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    use_processes: bool = True,
) -> list[float]:
    """One-shot scoring with a temporary `RewardComputer` (blocking; returns the list of rewards).

    Starting worker processes costs about a second; a training loop should keep one
    `RewardComputer` and call its `submit` every step instead.
    """
    with RewardComputer(reward_fn, num_workers, timeout_s, use_processes) as computer:
        return computer(responses, answers)
