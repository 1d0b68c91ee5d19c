"""The word-problem task of configs/smollm2_135m_word.py: the seeded split is disjoint and is the
bundled one, and the verifier reads the response's final number (or its last \\boxed{})."""

import json
import os

from qurl_jax.data import word_problems as wp

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_split_is_disjoint_and_matches_the_bundled_files(tmp_path):
    wp.main(["--out", str(tmp_path)])
    for name, count in (("train", 4000), ("test", 256)):
        ours = (tmp_path / f"{name}.jsonl").read_text()
        with open(os.path.join(REPO, "examples", "word_problems", f"{name}.jsonl")) as f:
            assert ours == f.read()
        assert len(ours.splitlines()) == count
    train = {json.loads(r)["problem"] for r in (tmp_path / "train.jsonl").read_text().splitlines()}
    test = [json.loads(r) for r in (tmp_path / "test.jsonl").read_text().splitlines()]
    assert not train & {r["problem"] for r in test}
    assert len({r["problem"] for r in test}) == 256


def test_answers_are_whole_numbers_of_the_story():
    train, test = wp.splits(50, 50, seed=3)
    for row in train + test:
        assert int(row["answer"]) >= 0


def test_final_number_reward():
    responses = ["18 + 23 = 41. So Mia has 41 stickers.", "41 stickers, then 5 more",
                 "\\boxed{41} or 7", "She has forty-one.", "1,041", "41.0"]
    assert wp.final_number_reward(responses, ["41", "41", "41", "41", "1041", "41"]) == [
        1.0, 0.0, 1.0, 0.0, 1.0, 1.0]
