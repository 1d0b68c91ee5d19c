"""`qurl_jax.bench.sampler`'s paged case: the pool it sizes, its flags, and (slow) a tiny run in
which the paged pool must return refill tail's tokens."""

from __future__ import annotations

import numpy as np
import pytest

from qurl_jax.bench import sampler as bench


def test_paged_pool_holds_the_fixed_slots_memory():
    # 16 slots of 128 + 256 tokens: 24 pages of 16 each; a row's partly used last page counts.
    assert bench.paged_pool_pages(16, 128, 256, 16) == 16 * 24
    assert bench.paged_pool_pages(2, 10, 20, 16) == 2 * 2
    assert bench.paged_case(1) == "paged tail" and bench.paged_case(2) == "paged tail 2x"


def test_token_check_allows_rounding_but_not_a_wrong_prefix():
    tokens = np.array([[1, 2, 3], [4, 5, 6]])
    logp = np.full((2, 3), -1.0)
    assert bench.token_check((tokens, logp), (tokens, logp), 0.02).startswith("0 of 2")
    parted = tokens.copy()
    parted[1, 2] = 7  # row 1 takes another token at its last position
    near = logp + np.array([[0.0, 0.0, 0.0], [0.01, 0.0, 0.5]])  # after the split: anything
    assert bench.token_check((parted, near), (tokens, logp), 0.02).startswith(
        "1 of 2 rows")
    with pytest.raises(RuntimeError, match="log-probs differ by 0.3"):
        bench.token_check((parted, logp + 0.3), (tokens, logp), 0.02)


@pytest.mark.parametrize("flags", [["--paged-scales", "0"], ["--paged-scales", "x"],
                                   ["--page-size", "0"], ["--max-steps-per-call", "-1"]])
def test_bad_paged_flags_exit(flags, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--cases", "paged", *flags])
    assert exit_info.value.code != 0
    assert flags[0] in capsys.readouterr().err


@pytest.mark.slow
def test_tiny_paged_run_matches_refill_tail(capsys):
    bench.main(["--cases", "paged", "--engines", "fp32", "--layers", "1", "--prompt-len", "16",
                "--new-tokens", "32", "--tail-prompts", "2", "--tail-n", "2", "--tail-slots", "2",
                "--rounds", "1", "--page-size", "8"])
    out = capsys.readouterr().out
    assert "fp32: paged tail / refill tail" in out and "fp32: paged tail 2x / refill tail" in out
    assert out.count("differ from refill tail's (log-probs before: within") == 2


@pytest.mark.slow
def test_decode_times_the_int8_vocabulary_tables_beside_int8(capsys):
    # The trainer's default rollout actor (rollout.quantize_vocab) beside the plain int8 one, in
    # one run, through the sampler's CPU decode preparation of the tied int8 head.
    bench.main(["--cases", "decode", "--engines", "int8,int8_vocab", "--layers", "1",
                "--batch", "2", "--prompt-len", "8", "--new-tokens", "4", "--rounds", "1"])
    out = capsys.readouterr().out
    assert "ours int8_vocab" in out and "ours int8_vocab / ours int8 decode tokens/s:" in out
