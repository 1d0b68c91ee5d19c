"""Math data loading, prompts, the resumable prompt iterator, arithmetic task and char tokenizer."""

import json
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from qurl_jax.data import (
    MATH_DATA_DIR,
    MATH_EVAL_SETS,
    PROMPT_TEMPLATE,
    ArithmeticConfig,
    MathExample,
    PromptIterator,
    arithmetic_prompt,
    arithmetic_splits,
    build_char_tokenizer,
    build_prompt,
    evaluate_expression,
    generate_arithmetic,
    load_math_file,
    sft_pairs,
)


def _readme_row_counts() -> dict[str, int]:
    """file -> rows, read from the table in third_party/math_data/README.md."""
    text = (MATH_DATA_DIR / "README.md").read_text()
    return {m[1]: int(m[2]) for m in re.finditer(r"^\| (\S+\.json) \| (\d+) \|", text, re.M)}


README_ROWS = _readme_row_counts()
# By inspection of train_math.json: rows 886 and 1009 have answer null, rows 5328 and 5330 "".
EXPECTED_SKIPS = {"train_math.json": {"missing answer": 2, "empty answer": 2}}


def test_readme_lists_every_data_file():
    on_disk = {p.name for p in MATH_DATA_DIR.glob("*.json")}
    assert set(README_ROWS) == on_disk
    assert len(README_ROWS) == 7
    assert set(MATH_EVAL_SETS.values()) <= on_disk


@pytest.mark.parametrize("name", sorted(README_ROWS))
def test_bundled_file_row_counts(name):
    examples, stats = load_math_file(MATH_DATA_DIR / name)
    skipped = EXPECTED_SKIPS.get(name, {})
    assert stats.total_rows == README_ROWS[name]
    assert stats.skipped == skipped
    assert stats.loaded == len(examples) == README_ROWS[name] - sum(skipped.values())
    assert stats.layout == "problem_answer"
    assert all(isinstance(e.problem, str) and e.problem for e in examples)
    assert all(isinstance(e.answer, str) and e.answer == e.answer.strip() for e in examples)
    assert {e.source for e in examples} == {Path(name).stem}


def test_bundled_answers_are_normalised():
    amc, amc_stats = load_math_file(MATH_DATA_DIR / "test_amc.json")
    assert amc[0].answer == "142"  # stored as the float 142.0
    assert amc_stats.normalised_answers == 83
    minerva, _ = load_math_file(MATH_DATA_DIR / "test_minerva.json")
    assert minerva[0].answer == "9.6" and minerva[0].alternatives == ()  # stored as ["9.6\n"]
    # Row 10 stores ['6630.65\n', '6630\n']: two accepted forms.
    (row,) = [e for e in minerva if e.answer == "6630.65"]
    assert row.gold_answers == ("6630.65", "6630")
    joined, _ = load_math_file(MATH_DATA_DIR / "test_minerva.json", list_answers="join")
    assert [e.answer for e in joined if e.index == row.index] == ["6630.65, 6630"]


BAD_ROWS = [
    {"problem": "p0", "answer": "a0"},
    {"answer": "a1"},  # missing problem
    {"problem": 7, "answer": "a2"},  # non-string problem
    {"problem": None, "answer": "a3"},  # missing problem
    {"problem": "p4", "answer": 7},
    {"problem": "p5", "answer": 2.5},
    {"problem": "p6", "answer": 3.0},
    {"problem": "p7", "answer": [1, "2 ", 1.0]},
    {"problem": "p8"},  # missing answer
    {"problem": "p9", "answer": {"x": 1}},  # unsupported answer type dict
    {"problem": "p10", "answer": True},  # unsupported answer type bool
    {"problem": "  ", "answer": "a11"},  # empty problem
    {"problem": "p12", "answer": []},  # empty answer
    ["not", "an", "object"],
    {"problem": "p14", "answer": -0.125},
]
EXPECTED_BAD_ROW_SKIPS = {
    "missing problem": 2,
    "non-string problem": 1,
    "missing answer": 1,
    "unsupported answer type dict": 1,
    "unsupported answer type bool": 1,
    "empty problem": 1,
    "empty answer": 1,
    "row is not an object": 1,
}
EXPECTED_BAD_ROW_EXAMPLES = [
    ("p0", "a0", ()),
    ("p4", "7", ()),
    ("p5", "2.5", ()),
    ("p6", "3", ()),
    ("p7", "1", ("2",)),
    ("p14", "-0.125", ()),
]


def _check_bad_rows(examples, stats, broken_lines=0):
    assert stats.total_rows == len(BAD_ROWS) + broken_lines
    expected = dict(EXPECTED_BAD_ROW_SKIPS)
    if broken_lines:
        expected["invalid JSON line"] = broken_lines
    assert stats.skipped == expected
    assert [(e.problem, e.answer, e.alternatives) for e in examples] == EXPECTED_BAD_ROW_EXAMPLES
    assert stats.normalised_answers == 5


def test_jsonl_with_bad_rows(tmp_path):
    path = tmp_path / "bad.jsonl"
    lines = [json.dumps(r) for r in BAD_ROWS]
    lines.insert(3, "{not json")
    path.write_text("\n".join(lines) + "\n\n")
    examples, stats = load_math_file(path, source="mine")
    _check_bad_rows(examples, stats, broken_lines=1)
    assert {e.source for e in examples} == {"mine"}
    # Row numbers count every non-blank line, skipped ones included.
    assert [e.index for e in examples] == [0, 5, 6, 7, 8, 15]


def test_json_array_with_bad_rows(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(BAD_ROWS))
    examples, stats = load_math_file(path)
    _check_bad_rows(examples, stats)
    assert [e.index for e in examples] == [0, 4, 5, 6, 7, 14]
    joined, _ = load_math_file(path, list_answers="join")
    assert joined[4].answer == "1, 2" and joined[4].alternatives == ()


def test_parquet_with_bad_rows(tmp_path):
    table = pa.table(
        {
            "problem": ["p0", None, "p2", "p3", "", "p5"],
            "answer": [1.5, 2.0, None, float("nan"), 4.0, -3.0],
            "solution": ["s"] * 6,
        }
    )
    path = tmp_path / "rows.parquet"
    pq.write_table(table, path)
    examples, stats = load_math_file(path)
    assert stats.total_rows == 6
    assert stats.skipped == {
        "missing problem": 1,
        "missing answer": 1,
        "non-finite answer": 1,
        "empty problem": 1,
    }
    assert [(e.problem, e.answer) for e in examples] == [("p0", "1.5"), ("p5", "-3")]


DAPO_INSTRUCTION = (
    "Solve the following math problem step by step. The last line of your response should be of "
    "the form Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_REMINDER = '\n\nRemember to put your answer on its own line after "Answer:".'


def test_dapo_layout_parquet(tmp_path):
    def prompt(text):
        return [{"role": "user", "content": DAPO_INSTRUCTION + text + DAPO_REMINDER}]

    def truth(value):
        return {"ground_truth": value, "style": "rule"}

    rows = [
        {"prompt": prompt("What is $1+1$?"), "reward_model": truth("2")},
        {"prompt": None, "reward_model": truth("3")},
        {"prompt": [{"role": "system", "content": "hi"}], "reward_model": truth("4")},
        {"prompt": prompt("Find $x$."), "reward_model": truth(None)},
        {"prompt": prompt("Find $y$."), "reward_model": None},
        {"prompt": [{"role": "user", "content": "Plain $2+3$?"}], "reward_model": truth("5")},
    ]
    path = tmp_path / "dapo.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    examples, stats = load_math_file(path)
    assert stats.layout == "dapo"
    assert stats.skipped == {
        "non-list prompt": 1,
        "prompt without user message": 1,
        "missing answer": 1,
        "reward_model is not an object": 1,
    }
    assert [(e.problem, e.answer, e.index) for e in examples] == [
        ("What is $1+1$?", "2", 0),
        ("Plain $2+3$?", "5", 5),
    ]


def test_gsm8k_layout(tmp_path):
    path = tmp_path / "gsm8k.jsonl"
    rows = [
        {"question": "How many?", "answer": "Two and two.\n#### 4"},
        {"question": "How much?", "answer": "Lots.\n#### 1,250"},
        {"question": "Broken", "answer": "no marker"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows))
    examples, stats = load_math_file(path)
    assert stats.layout == "gsm8k"
    assert [(e.problem, e.answer) for e in examples] == [("How many?", "4"), ("How much?", "1250")]
    assert stats.skipped == {"gsm8k answer without ####": 1}


def test_missing_and_unsupported_files(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(FileNotFoundError, match="nope.json"):
        load_math_file(missing)
    other = tmp_path / "rows.csv"
    other.write_text("problem,answer\n")
    with pytest.raises(ValueError, match="rows.csv"):
        load_math_file(other)


def test_build_prompt_plain_and_chat(tmp_path):
    assert PROMPT_TEMPLATE.endswith("within \\boxed{}.")
    expected = "What is 2+2? Let's think step by step and output the final answer within \\boxed{}."
    assert build_prompt("What is 2+2?") == expected
    tokenizer = build_char_tokenizer()
    assert build_prompt("What is 2+2?", tokenizer, chat=False) == expected
    chat = build_prompt("What is 2+2?", tokenizer)
    assert chat == "<|bos|><|user|>" + expected + "<|assistant|>"
    assert arithmetic_prompt("12+7=", tokenizer) == "<|bos|><|user|>12+7=<|assistant|>"
    assert arithmetic_prompt("12+7=") == "12+7="


def _examples(n):
    return [MathExample(f"p{i}", str(i), "toy", i) for i in range(n)]


def test_prompt_iterator_epochs_are_permutations():
    it = PromptIterator(_examples(10), batch_size=3, seed=5)
    stream = [e.index for _ in range(10) for e in next(it)]  # 30 items = 3 epochs
    epochs = [stream[i : i + 10] for i in range(0, 30, 10)]
    for order in epochs:
        assert sorted(order) == list(range(10))
    assert len({tuple(o) for o in epochs}) == 3
    assert it.epoch == 2
    same = PromptIterator(_examples(10), batch_size=3, seed=5)
    assert [e.index for _ in range(10) for e in next(same)] == stream
    other = PromptIterator(_examples(10), batch_size=3, seed=6)
    assert [e.index for _ in range(10) for e in next(other)] != stream
    ordered = PromptIterator(_examples(4), batch_size=3, shuffle=False)
    assert [[e.index for e in next(ordered)] for _ in range(3)] == [[0, 1, 2], [3, 0, 1], [2, 3, 0]]


@pytest.mark.parametrize("consumed", [0, 1, 3, 4, 9])
def test_prompt_iterator_state_restore(consumed):
    reference = PromptIterator(_examples(7), batch_size=3, seed=11)
    for _ in range(consumed):
        next(reference)
    state = json.loads(json.dumps(reference.state()))
    expected = [[e.index for e in next(reference)] for _ in range(5)]
    resumed = PromptIterator(_examples(7), batch_size=3, seed=11)
    next(resumed)  # a different position, overwritten by restore
    resumed.restore(state)
    assert [[e.index for e in next(resumed)] for _ in range(5)] == expected


def test_prompt_iterator_restore_rejects_mismatch():
    state = PromptIterator(_examples(7), batch_size=3, seed=11).state()
    with pytest.raises(ValueError, match="seed"):
        PromptIterator(_examples(7), batch_size=3, seed=12).restore(state)
    with pytest.raises(ValueError, match="num_examples"):
        PromptIterator(_examples(8), batch_size=3, seed=11).restore(state)
    with pytest.raises(ValueError, match="position"):
        PromptIterator(_examples(7), batch_size=3, seed=11).restore({"epoch": 0, "seed": 11})
    with pytest.raises(ValueError, match="empty"):
        PromptIterator([], batch_size=3)


@pytest.mark.parametrize(
    "operands, operators, expected",
    [([2, 3], ["+"], 5), ([2, 3, 4], ["+", "*"], 14), ([10, 2, 3, 1], ["-", "*", "-"], 3),
     ([5, 9], ["-"], -4), ([3, 4, 5], ["*", "*"], 60)],
)
def test_evaluate_expression(operands, operators, expected):
    assert evaluate_expression(operands, operators) == expected


@pytest.mark.parametrize(
    "config",
    [ArithmeticConfig(), ArithmeticConfig(1, 3, ("+", "-", "*"), 3, True),
     ArithmeticConfig(2, 2, ("*",))],
)
def test_generate_arithmetic(config):
    examples = generate_arithmetic(200, seed=3, config=config)
    assert examples == generate_arithmetic(200, seed=3, config=config)
    assert examples != generate_arithmetic(200, seed=4, config=config)
    for ex in examples:
        expression = ex.problem[:-1]
        assert ex.problem.endswith("=")
        operands = re.split(r"[-+*]", expression)
        assert len(operands) == config.num_operands
        assert all(config.min_digits <= len(x) <= config.max_digits for x in operands)
        assert set(re.findall(r"[-+*]", expression)) <= set(config.operators)
        assert ex.answer == str(eval(expression))  # Python's own arithmetic as the oracle
        assert config.allow_negative or int(ex.answer) >= 0


def test_arithmetic_splits_are_disjoint_and_config_is_checked():
    train, evaluation = arithmetic_splits(300, 100, seed=0)
    problems = [e.problem for e in train + evaluation]
    assert len(train) == 300 and len(evaluation) == 100
    assert len(set(problems)) == 400
    with pytest.raises(ValueError, match="distinct"):
        arithmetic_splits(90, 20, config=ArithmeticConfig(1, 1, ("+",)))  # only 100 problems
    with pytest.raises(ValueError, match="operators"):
        generate_arithmetic(1, config=ArithmeticConfig(operators=("/",)))
    with pytest.raises(ValueError, match="max_digits"):
        generate_arithmetic(1, config=ArithmeticConfig(min_digits=3, max_digits=2))


def test_sft_pairs():
    examples = [MathExample("12+7=", "19", "arith", 0)]
    assert sft_pairs(examples) == [("12+7=", "19")]
    tokenizer = build_char_tokenizer()
    assert sft_pairs(examples, tokenizer) == [
        ("<|bos|><|user|>12+7=<|assistant|>", "19<|eos|>")
    ]


def test_char_tokenizer_round_trip(tmp_path):
    built = build_char_tokenizer(tmp_path / "tok")
    loaded = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert len(loaded) == len(built) < 128
    assert (loaded.pad_token_id, loaded.bos_token_id, loaded.eos_token_id) == (0, 1, 2)
    assert loaded.unk_token_id == 3
    text = "x = \\boxed{\\frac{1}{2}} (12+7*3-4)/5; A_b^c!\n\tok?"
    ids = loaded.encode(text, add_special_tokens=False)
    assert len(ids) == len(text)  # one token per character
    assert ids == built.encode(text, add_special_tokens=False)
    assert loaded.decode(ids) == text
    prompt, completion = sft_pairs([MathExample("12+7=", "19", "arith", 0)], loaded)[0]
    ids = loaded.encode(prompt + completion, add_special_tokens=False)
    assert ids[:2] == [1, 4] and ids[-1] == 2 and ids[-4] == 5
    assert len(ids) == 2 + 5 + 1 + 2 + 1
    assert loaded.decode(ids, skip_special_tokens=True) == "12+7=19"
    assert loaded.encode("é", add_special_tokens=False) == [3]


def test_noisy_teacher_keeps_answers_and_adds_stray_end_characters():
    from qurl_jax.train.warm_start import FORMAT_JUNK, noisy_teacher_pairs

    pairs = [(f"{a}+1=", f"{a + 1}</s>") for a in range(200)]
    assert noisy_teacher_pairs(pairs, 0.0, seed=0, eos="</s>") == pairs
    noisy = noisy_teacher_pairs(pairs, 0.5, seed=0, eos="</s>")
    changed = 0
    for (prompt, clean), (noisy_prompt, completion) in zip(pairs, noisy, strict=True):
        assert noisy_prompt == prompt and completion.endswith("</s>")
        body = completion.removesuffix("</s>")
        if body != clean.removesuffix("</s>"):
            changed += 1
            assert body[:-1] == clean.removesuffix("</s>") and body[-1] in FORMAT_JUNK
    assert 70 < changed < 130
