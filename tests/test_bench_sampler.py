"""`qurl_jax.bench.sampler`'s paged case: the pool it sizes, its flags, and (slow) a tiny run in
which the paged pool must return refill tail's tokens."""

from __future__ import annotations

import pytest

from qurl_jax.bench import sampler as bench


def test_paged_pool_holds_the_fixed_slots_memory():
    # 16 slots of 128 + 256 tokens: 24 pages of 16 each; a row's partly used last page counts.
    assert bench.paged_pool_pages(16, 128, 256, 16) == 16 * 24
    assert bench.paged_pool_pages(2, 10, 20, 16) == 2 * 2
    assert bench.paged_case(1) == "paged tail" and bench.paged_case(2) == "paged tail 2x"


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
    assert "fp32 paged tail / refill tail" in out and "fp32 paged tail 2x / refill tail" in out
    assert out.count("tokens identical") == 2
