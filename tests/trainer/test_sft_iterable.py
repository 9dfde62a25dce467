"""SFT preparation of an iterable dataset (``datasets.IterableDataset``): the rows are checked as the
trainer reads them (past the first 1000 that format detection reads up front), with the same
errors naming the row as for a map-style dataset, the same output, and truncations counted and
reported once."""
import warnings

import pytest

pytest.importorskip("trl")

from datasets import Dataset, IterableDataset  # noqa: E402

from megatrain_nb.assets import as_format  # noqa: E402
from megatrain_nb.trainer.data import DataError  # noqa: E402
from megatrain_nb.trainer.sft_data import SFTDataOptions  # noqa: E402
from megatrain_nb.trainer.sft_prepare import prepare_sft_dataset  # noqa: E402

from .sft_helpers import CONVS, tokenizer  # noqa: E402

HEAD = 1000   # rows format detection reads before training: a bad row after them is met while training


def _opts(**kw):
    base = dict(max_length=None, truncation_mode="keep_start", dataset_text_field="text", packing=False,
                packing_strategy="bfd", shuffle_dataset=False, seed=0, completion_only_loss=True,
                assistant_only_loss=False, chat_template=None)
    base.update(kw)
    return SFTDataOptions(**base)


def _stream(rows):
    def gen():
        yield from rows
    return IterableDataset.from_generator(gen)


def _rows(fmt="messages", n=8):
    return [as_format(CONVS[i % len(CONVS)], fmt) for i in range(n)]


def _read(ds):
    return [(r["input_ids"], r["labels"]) for r in ds]


@pytest.mark.parametrize("fmt,opts", [("messages", dict(assistant_only_loss=True)),
                                      ("prompt_completion", dict(max_length=24)),
                                      ("alpaca", {}), ("sharegpt", {}),
                                      ("messages", dict(max_length=40, packing=True))])
@pytest.mark.parametrize("typed", [False, True], ids=["generator", "with-features"])
def test_iterable_prepares_as_map_style(fmt, opts, typed):
    tok, rows = tokenizer(), _rows(fmt, 12)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager, _ = prepare_sft_dataset(Dataset.from_list(rows), tok, _opts(**opts))
        stream = Dataset.from_list(rows).to_iterable_dataset() if typed else _stream(rows)
        lazy, _ = prepare_sft_dataset(stream, tok, _opts(**opts))
        assert _read(lazy) == _read(eager)
    assert len(_read(eager)) > 0


def _bad_at(bad_row, fmt="messages"):
    rows = _rows(fmt, HEAD + 3)
    rows[HEAD + 1] = bad_row
    return rows


def test_mixed_formats_past_the_head_are_refused_with_the_row():
    out, _ = prepare_sft_dataset(_stream(_bad_at(as_format(CONVS[0], "alpaca"))), tokenizer(), _opts())
    with pytest.raises(DataError, match=rf"mixes formats: row {HEAD + 1} is alpaca, the rows before it messages"):
        _read(out)


def test_unknown_row_past_the_head_is_refused_with_its_keys():
    out, _ = prepare_sft_dataset(_stream(_bad_at({"question": "two ?"})), tokenizer(), _opts())
    with pytest.raises(DataError, match=rf"train_dataset\[{HEAD + 1}\] has keys \['question'\]"):
        _read(out)


def test_empty_assistant_turn_past_the_head_is_refused():
    bad = {"messages": [{"role": "user", "content": "What is one plus one ?"}, {"role": "assistant", "content": " "}]}
    out, _ = prepare_sft_dataset(_stream(_bad_at(bad)), tokenizer(), _opts())
    with pytest.raises(DataError, match=rf"train_dataset\[{HEAD + 1}\] has an empty assistant turn"):
        _read(out)


def test_role_the_template_cannot_render_past_the_head_is_refused():
    bad = {"messages": [{"role": "tool", "content": "weather"}] + _rows()[0]["messages"]}
    out, _ = prepare_sft_dataset(_stream(_bad_at(bad)), tokenizer(), _opts())
    with pytest.raises(DataError, match=rf"train_dataset\[{HEAD + 1}\].*cannot render.*tool"):
        _read(out)


def test_bad_sharegpt_role_past_the_head_is_refused():
    bad = {"conversations": [{"from": "narrator", "value": "once"}, {"from": "gpt", "value": "yes ."}]}
    out, _ = prepare_sft_dataset(_stream(_bad_at(bad, "sharegpt")), tokenizer(), _opts())
    with pytest.raises(DataError, match=rf"train_dataset\[{HEAD + 1}\]: sharegpt role 'narrator'"):
        _read(out)


def test_no_chat_template_is_refused_before_training():
    tok = tokenizer()
    tok.chat_template = None
    with pytest.raises(DataError, match="no chat template.*chat_template_path"):
        prepare_sft_dataset(_stream(_rows()), tok, _opts())


def test_no_target_without_truncation_is_refused_with_the_row():
    rows = [{"input_ids": [5, 6, 7], "labels": [-100, 6, 7]} for _ in range(6)]
    rows[4] = {"input_ids": [5, 6, 7], "labels": [-100, -100, -100]}   # pre-tokenised, all masked
    with pytest.raises(DataError, match=r"train_dataset\[4\] has no token counted in the loss"):
        prepare_sft_dataset(Dataset.from_list(rows), tokenizer(), _opts())
    out, _ = prepare_sft_dataset(_stream(rows), tokenizer(), _opts())
    with pytest.raises(DataError, match=r"train_dataset\[4\] has no token counted in the loss"):
        _read(out)


def test_truncation_is_counted_as_read_and_reported_once():
    tok, rows = tokenizer(), _rows("messages", 16)
    lengths = [len(tok.apply_chat_template(r["messages"], tokenize=True, return_dict=True)["input_ids"]) for r in rows]
    m = 20
    out, report = prepare_sft_dataset(_stream(rows), tok, _opts(max_length=m))
    assert report.truncated == 0   # nothing read yet
    with pytest.warns(UserWarning, match="more than max_length=20") as rec:
        got = _read(out)
    assert sum("max_length" in str(w.message) for w in rec) == 1
    assert report.examples == len(rows)
    assert report.truncated == sum(n > m for n in lengths) > 1
    assert report.tokens_dropped == sum(max(n - m, 0) for n in lengths)
    assert all(len(ids) <= m for ids, _ in got)


def test_completion_empty_after_truncation_is_dropped_and_counted_as_read():
    long_prompt = "What is " + " plus ".join(["one"] * 30) + " ?"
    rows = _rows("prompt_completion", 6)
    rows[3] = {"prompt": [{"role": "user", "content": long_prompt}],
               "completion": [{"role": "assistant", "content": "many ."}]}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out, report = prepare_sft_dataset(_stream(rows), tokenizer(), _opts(max_length=40))
        assert len(_read(out)) == 5
    assert report.no_target_dropped == 1 and report.examples == 6


def test_sft_trainer_trains_on_an_iterable_dataset(tmp_path):
    import megatrain_nb as mt

    from .sft_helpers import sft_config, tiny_llama

    tok = tokenizer()
    t = mt.SFTTrainer(model=tiny_llama(len(tok)), args=sft_config(tmp_path, max_steps=2, max_length=20),
                      train_dataset=_stream(_rows("messages", 16)), processing_class=tok, device="cpu")
    with pytest.warns(UserWarning, match="more than max_length=20"):
        records = list(t.iter_steps())
    assert [r["step"] for r in records] == [1, 2]
    assert t.prep_reports[0].truncated >= 1
    t.close()
