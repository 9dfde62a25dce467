"""Datasets in, batches out: accepted forms, packing, collation, order and restorable position."""
import pytest
import torch
from datasets import Dataset, IterableDataset

from megatrain_nb.trainer.data import (
    BatchStream,
    DataError,
    PaddingCollator,
    finish_batch,
    pack_token_stream,
    prepare_dataset,
)

from .helpers import token_rows


class _Tok:
    """A character-level stand-in tokenizer (ids = byte values; EOS = 0)."""
    eos_token_id = 0
    pad_token_id = 0

    def __call__(self, texts, add_special_tokens=False):
        if isinstance(texts, str):
            return {"input_ids": list(texts.encode())}
        return {"input_ids": [list(t.encode()) for t in texts]}


def test_collator_pads_and_masks_padding_out_of_the_loss():
    batch = PaddingCollator(pad_token_id=9)([{"input_ids": [1, 2, 3]}, {"input_ids": [4, 5]}])
    assert batch["input_ids"].tolist() == [[1, 2, 3], [4, 5, 9]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 1, 0]]
    assert batch["labels"].tolist() == [[1, 2, 3], [4, 5, -100]]


def test_collator_keeps_given_labels_and_drops_an_all_ones_mask():
    batch = PaddingCollator()([{"input_ids": [1, 2], "labels": [-100, 2], "attention_mask": [1, 1]}])
    assert batch["labels"].tolist() == [[-100, 2]]
    assert "attention_mask" not in batch  # same result as no mask, and faster


def test_finish_batch_adds_labels_to_a_collators_output():
    out = finish_batch({"input_ids": [[1, 2, 3]], "attention_mask": [[1, 1, 0]]})
    assert out["labels"].tolist() == [[1, 2, -100]]


def test_dataset_with_neither_input_ids_nor_text():
    with pytest.raises(DataError, match=r"columns \['foo'\].*'input_ids'.*'text'"):
        prepare_dataset(Dataset.from_dict({"foo": [1, 2]}))


def test_empty_dataset():
    with pytest.raises(DataError, match="empty"):
        prepare_dataset(Dataset.from_dict({"input_ids": []}))
    with pytest.raises(DataError, match="empty"):
        prepare_dataset([])


def test_sequences_too_short_to_train_on():
    with pytest.raises(DataError, match=r"\[1\] has 1 token"):
        prepare_dataset(Dataset.from_dict({"input_ids": [[1, 2, 3], [4]]}))
    with pytest.raises(DataError, match="at least 2"):
        PaddingCollator()([{"input_ids": [7]}])


def test_text_without_tokenizer_and_text_too_short():
    ds = Dataset.from_dict({"text": ["hello"]})
    with pytest.raises(DataError, match="no tokenizer"):
        prepare_dataset(ds, seq_len=8)
    with pytest.raises(DataError, match="too short"):
        prepare_dataset(ds, tokenizer=_Tok(), seq_len=64)


def test_text_is_tokenised_and_packed_with_eos_between_documents():
    ds = Dataset.from_dict({"text": ["abc", "defg", "hi", "j"]})
    out = prepare_dataset(ds, tokenizer=_Tok(), seq_len=4)
    stream = [c for t in ["abc", "defg", "hi"] for c in list(t.encode()) + [0]]
    assert [r["input_ids"] for r in out] == [stream[0:4], stream[4:8], stream[8:12]]
    assert list(pack_token_stream(iter([[1, 2], [3]]), 2, None)) == [[1, 2]]


def test_iterable_text_is_packed_lazily():
    def gen():
        for t in ["abcdef", "ghij"]:
            yield {"text": t}
    out = prepare_dataset(IterableDataset.from_generator(gen), tokenizer=_Tok(), seq_len=5)
    blocks = [ex["input_ids"] for ex in out]
    assert blocks == [list(b"abcde"), list(b"f") + [0] + list(b"ghi")]


def test_torch_datasets_and_lists_are_accepted():
    class Ds(torch.utils.data.Dataset):
        def __len__(self):
            return 3

        def __getitem__(self, i):
            return {"input_ids": torch.arange(4) + i}
    assert prepare_dataset(Ds()) is not None
    assert prepare_dataset(token_rows(3)) is not None


def test_order_matches_the_seedable_sampler_transformers_trainer_uses():
    from accelerate.data_loader import SeedableRandomSampler

    n, seed = 11, 42
    stream = BatchStream(list(range(n)), batch_size=1, collate=lambda ex: {"input_ids": torch.tensor([[ex[0], 0]])},
                         seed=seed)
    sampler = SeedableRandomSampler(data_source=range(n), data_seed=seed)
    for epoch in range(2):
        sampler.set_epoch(epoch)
        ours = []
        while True:
            window, ended = stream.next_window(4)
            ours += [int(b["input_ids"][0, 0]) for b in window]
            if ended:
                break
        stream.start_next_epoch()
        assert ours == list(sampler)


def _take(stream, windows):
    out = []
    for _ in range(windows):
        window, ended = stream.next_window(2)
        out.append([b["input_ids"].tolist() for b in window])
        if ended:
            stream.start_next_epoch()
    return out


@pytest.mark.parametrize("iterable", [False, True])
def test_position_restores_the_same_continuation(iterable):
    rows = token_rows(9, seq=4)
    ds = IterableDataset.from_generator(lambda: iter(rows)) if iterable else Dataset.from_list(rows)
    collate = PaddingCollator()
    a = BatchStream(ds, batch_size=2, collate=collate, seed=3)
    _take(a, 2)
    saved = a.state_dict()
    expected = _take(a, 4)  # crosses an epoch boundary
    b = BatchStream(ds, batch_size=2, collate=collate, seed=3)
    b.load_state_dict(saved)
    assert _take(b, 4) == expected
