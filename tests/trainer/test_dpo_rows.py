"""DPO rows that could not train, named by their index (issue 44 item 8): refused when the pair
cannot mean anything (a missing side, an empty answer or message, the same tokens on both sides,
two different conversations as an implicit prompt, an empty tokenised completion, a non-finite
reference column); warned when max_length cuts a pair down to the same tokens on both sides (the
pair is kept: it carries no gradient, and a longer max_length would restore it)."""
import pytest

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402

from megatrain_nb.trainer.data import DataError  # noqa: E402
from megatrain_nb.trainer.dpo_data import prepare_preference_dataset  # noqa: E402

from .dpo_helpers import pairs, tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return tokenizer()


def _prepare(tok, rows, max_length=48, lazy=False):
    ds = Dataset.from_list(rows).to_iterable_dataset() if lazy else rows
    out, report = prepare_preference_dataset(ds, tok, max_length=max_length, truncation_mode="keep_start",
                                             what="train_dataset")
    if lazy:
        list(out)   # read: each row is checked as it is read
    return out, report


def _no_chosen(rows, tok):
    del rows[2]["chosen"]


def _conv_rejected_empty(rows, tok):
    rows[1]["rejected"] = []


def _empty_assistant(rows, tok):
    rows[3]["chosen"] = [{"role": "assistant", "content": "  "}]


CONVERSATIONAL = [
    (_no_chosen, r"row 2 has no 'chosen'"),
    (_conv_rejected_empty, r"row 1: 'rejected' is an empty list of messages"),
    (_empty_assistant, r"row 3: 'chosen' message 0 \(assistant\) is empty"),
]


@pytest.mark.parametrize("damage,message", CONVERSATIONAL, ids=["no-chosen", "rejected-empty-list", "empty-message"])
def test_conversational_rows_refused_naming_the_row(tok, damage, message):
    rows = pairs(6)
    damage(rows, tok)
    with pytest.raises(DataError, match="train_dataset " + message):
        _prepare(tok, rows)


def test_implicit_prompt_pairs_from_two_conversations_are_refused(tok):
    rows = pairs(6, implicit=True)
    rows[4]["rejected"] = pairs(6, implicit=True)[1]["rejected"]   # another conversation's
    with pytest.raises(DataError, match=r"train_dataset row 4: chosen and rejected \(no 'prompt' column\) are two "
                                        "different conversations"):
        _prepare(tok, rows)
    rows = pairs(6, implicit=True)
    rows[2]["rejected"] = rows[2]["chosen"][:-1] + [{"role": "user", "content": "and?"},
                                                    {"role": "assistant", "content": "x"}]
    with pytest.raises(DataError, match=r"row 2: .* they differ at a 'user' turn"):
        _prepare(tok, rows)


@pytest.mark.parametrize("answer", ["", "   ", "\n\t"])
def test_empty_or_whitespace_text_answers_are_refused(tok, answer):
    rows = pairs(6, fmt="text")
    rows[5]["rejected"] = answer
    with pytest.raises(DataError, match="train_dataset row 5: the rejected answer is empty"):
        _prepare(tok, rows)


def test_chosen_equal_to_rejected_plus_eos_is_refused(tok):
    rows = pairs(6, fmt="text")
    rows[3]["chosen"] = rows[3]["rejected"] + tok.eos_token
    with pytest.raises(DataError, match="train_dataset row 3: chosen and rejected are the same tokens once tokenised"):
        _prepare(tok, rows)


def test_an_empty_chosen_ids_is_refused_in_a_tokenised_set(tok):
    prepared, _ = _prepare(tok, pairs(6))
    rows = prepared.select_columns(["prompt_ids", "chosen_ids", "rejected_ids"]).to_list()
    rows[4]["chosen_ids"] = []
    with pytest.raises(DataError, match="train_dataset row 4: the chosen completion is empty once tokenised"):
        _prepare(tok, Dataset.from_list(rows))
    rows[4]["chosen_ids"] = rows[4]["rejected_ids"]
    with pytest.raises(DataError, match="train_dataset row 4: chosen and rejected are the same tokens"):
        _prepare(tok, Dataset.from_list(rows))


def test_pairs_the_same_after_truncation_are_kept_and_warned_by_row(tok):
    rows = pairs(6, fmt="text")
    shared = " " + " ".join([rows[0]["chosen"].strip()] * 6)   # long enough to fill max_length before they differ
    rows[1]["chosen"], rows[1]["rejected"] = shared + rows[1]["chosen"], shared + rows[1]["rejected"]
    out, report = _prepare(tok, rows, max_length=30)
    assert report.same_after_truncation == (1,) and len(out) == 5   # (row 5's prompt alone fills 30: dropped)
    assert "1 of 6 pairs (row 1) have the same chosen and rejected tokens once cut to max_length" in report.message()
    _out, report = _prepare(tok, rows, max_length=256)
    assert report.same_after_truncation == () and report.message() == ""


def test_rows_read_lazily_get_the_same_checks(tok):
    rows = pairs(6, fmt="text")
    rows[4]["chosen"] = " "
    with pytest.raises(DataError, match="train_dataset row 4: the chosen answer is empty"):
        _prepare(tok, rows, lazy=True)
    rows = pairs(6, fmt="text")
    rows[2]["chosen"] = rows[2]["rejected"] + tok.eos_token
    with pytest.raises(DataError, match="train_dataset row 2: chosen and rejected are the same tokens"):
        _prepare(tok, rows, lazy=True)
