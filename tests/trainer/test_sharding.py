"""Dealing micro-batches over data-parallel ranks: N ranks x accumulation A consume exactly what
one rank x accumulation N*A does, step by step (simulated ranks, one process)."""
import pytest
import torch
from datasets import Dataset, IterableDataset

from megatrain_nb.trainer.data import BatchStream, PaddingCollator, count_targets, count_tokens
from megatrain_nb.trainer.sharding import ZERO_WEIGHT, deal, per_rank_count, rank_share

from .helpers import token_rows


@pytest.mark.parametrize("n", range(0, 13))
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_rank_shares_partition_in_order(n, world):
    shares = [rank_share(n, r, world) for r in range(world)]
    assert [i for sh in shares for i in sh] == list(range(n))
    assert max(len(s) for s in shares) == per_rank_count(n, world)
    assert max(len(s) for s in shares) - min(len(s) for s in shares) <= 1


def test_rank_share_rejects_bad_rank():
    with pytest.raises(ValueError, match="rank 2 / world size 2"):
        rank_share(4, 2, 2)


def _rows(stream, steps):
    """Per step: the sorted first tokens of the real rows, and the micro-batch count."""
    out = []
    for _ in range(steps):
        window, ended = stream.next_window(stream._acc)
        real = [b for b in window if not b.get(ZERO_WEIGHT)]
        out.append(([row[0] for b in real for row in b["input_ids"].tolist()], len(window),
                    sum(count_targets(b) for b in window), sum(count_tokens(b) for b in window),
                    len(window) - len(real)))
        if ended:
            stream.start_next_epoch()
    return out


def _stream(ds, acc, rank=0, world=1, bs=2):
    s = BatchStream(ds, batch_size=bs, collate=PaddingCollator(), seed=5, rank=rank, world=world)
    s._acc = acc
    return s


@pytest.mark.parametrize("iterable", [False, True])
@pytest.mark.parametrize("world,acc", [(2, 1), (2, 3), (3, 2)])
def test_ranks_together_see_the_one_rank_steps(iterable, world, acc):
    rows = token_rows(25, seq=6, masked=True)   # 13 micro-batches of 2: the last window is short, uneven
    ds = IterableDataset.from_generator(lambda: iter(rows)) if iterable else Dataset.from_list(rows)
    steps = 7                                    # crosses an epoch end with a short window
    one = _rows(_stream(ds, acc * world), steps)
    per_rank = [_rows(_stream(ds, acc, r, world), steps) for r in range(world)]
    for k in range(steps):
        union = [t for r in range(world) for t in per_rank[r][k][0]]
        assert union == one[k][0]                 # same samples, same global order
        counts = {per_rank[r][k][1] for r in range(world)}
        assert len(counts) == 1                   # every rank runs as many micro-batches
        assert sum(per_rank[r][k][2] for r in range(world)) == one[k][2]  # targets sum to one rank's
        assert sum(per_rank[r][k][3] for r in range(world)) == one[k][3]  # tokens likewise
    assert any(per_rank[r][k][4] > 0 for r in range(world) for k in range(steps))            # the epoch-end window did need zero-weight fillers


def test_short_window_pads_with_zero_weight_micro_batches():
    loads = [lambda i=i: {"input_ids": torch.tensor([[i, i + 1, i + 2]])} for i in range(3)]
    finish = lambda b: {**b, "labels": b["input_ids"].clone()}
    windows = [deal(loads, r, 2, finish) for r in range(2)]
    assert [len(w) for w in windows] == [2, 2]
    filler = windows[1][1]
    assert filler[ZERO_WEIGHT] and bool((filler["labels"] == -100).all())
    assert count_targets(filler) == 0 and count_tokens(filler) == 0
    # a rank with no real micro-batch at all still runs one, built from the window's first
    w = deal(loads[:1], 1, 2, finish)
    assert len(w) == 1 and w[0][ZERO_WEIGHT] and w[0]["input_ids"][0, 0] == 0


def test_position_is_global_and_moves_between_world_sizes():
    rows = token_rows(20, seq=6)
    ds = Dataset.from_list(rows)
    two = [_stream(ds, 2, r, 2) for r in range(2)]
    for s in two:
        _rows(s, 2)
    assert two[0].state_dict() == two[1].state_dict() == {"epoch": 0, "consumed": 8}
    one = _stream(ds, 4)
    one.load_state_dict(two[0].state_dict())
    rest_two = [_rows(s, 1)[0][0] for s in two]
    assert _rows(one, 1)[0][0] == rest_two[0] + rest_two[1]


def test_only_own_share_is_loaded():
    loaded = []

    class Ds(torch.utils.data.Dataset):
        def __len__(self):
            return 8

        def __getitem__(self, i):
            loaded.append(i)
            return {"input_ids": [i, i + 1, i + 2]}

    s = BatchStream(Ds(), batch_size=1, collate=PaddingCollator(), seed=0, shuffle=False, rank=1, world=2)
    window, _ = s.next_window(2)
    assert sorted(loaded) == [2, 3] and [int(b["input_ids"][0, 0]) for b in window] == [2, 3]
