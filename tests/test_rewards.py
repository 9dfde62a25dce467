"""The shipped verifiable task and its reward functions (issue 48 item 5): the shipped file is what
its generator makes, every prompt's answer is the sum, every word is in the shipped tokenizer,
and the rewards score a completion's first word (text or a conversational message)."""
import pytest

from megatrain_nb.assets import arithmetic_dataset, arithmetic_rows, chat_tokenizer
from megatrain_nb.assets.arithmetic import generate_arithmetic
from megatrain_nb.assets.words import NUMBERS
from megatrain_nb.rewards import SHIPPED, answers_with_a_number, arithmetic_correct


def test_the_shipped_file_is_the_generated_task_and_each_answer_is_the_sum():
    rows = arithmetic_rows()
    assert rows == generate_arithmetic() and len(rows) == 90
    assert len({r["prompt"] for r in rows}) == 90
    for r in rows:
        _, _, a, _, b, _ = r["prompt"].split()
        assert NUMBERS.index(a) + NUMBERS.index(b) == NUMBERS.index(r["answer"])
    tok = chat_tokenizer()
    for r in rows:
        assert tok.unk_token_id not in tok(r["prompt"] + " " + r["answer"])["input_ids"], r
    ds = arithmetic_dataset(3, conversational=True)
    assert ds.column_names == ["prompt", "answer"] and ds[0]["prompt"][0]["role"] == "user"


def test_the_rewards_read_the_first_word():
    completions = ["seven <eos>", "7", "eight", "seven plus", "", "the seven", [{"role": "assistant", "content": "Seven ."}]]
    answers = ["seven"] * len(completions)
    assert arithmetic_correct(completions, answer=answers) == [1.0, 1.0, 0.0, 1.0, 0.0, 0.0, 1.0]
    assert answers_with_a_number(completions) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0]
    assert SHIPPED == {"arithmetic_correct": arithmetic_correct, "answers_with_a_number": answers_with_a_number}


def test_a_dataset_without_answers_is_named():
    with pytest.raises(ValueError, match="'answer' column"):
        arithmetic_correct(["seven", "six"], answer=["seven"])
