"""mt.GRPOTrainer on several ranks (megatrain_nb/trainer/grpo_ranks.py): rollouts split across the
ranks, gathered, the run the same for any number of ranks at the same global batch.

One process: each rollout's draws come from its own stream (a batch split in two samples what the
whole batch samples; a batch decoded with another's streams does not), a rank whose rows all ended
keeps decoding in lockstep with filler passes (its completions unchanged), the sampling rule's
checks. Two gloo ranks (slow): 2 ranks x accumulation 1 x steps_per_generation 2 against one
process x accumulation 2 x steps_per_generation 4, per-rollout streams both: the same
completions, every logged value within 1e-5 relative, the final weights equal to round-off, and an
evaluation afterwards the same; the 2-rank run's checkpoints resumed in one process."""
import json
from pathlib import Path

import pytest
import torch

trl = pytest.importorskip("trl")
from transformers import GenerationConfig  # noqa: E402

from megatrain_nb.engine import EngineConfig, StreamingEngine  # noqa: E402
from megatrain_nb.engine.compute.decode import StreamedDecoder, draw  # noqa: E402
from megatrain_nb.trainer.grpo_ranks import (check_rollout_seeds, gather_rewards, gather_rows,  # noqa: E402
                                             rank_rows, row_generators, seeded_shuffle)
from megatrain_nb.trainer.grpo_rollout import RewardError  # noqa: E402

from ..distributed.launch import alone, check, torchrun  # noqa: E402
from .test_grpo_parity import NOT_COMPARED, tiny_model, tokenizer  # noqa: E402

WORKER = Path(__file__).with_name("grpo_ranks_worker.py")


@pytest.fixture(scope="module")
def decoder():
    tok = tokenizer()
    engine = StreamingEngine(tiny_model(tok), EngineConfig(device="cpu"))
    yield tok, StreamedDecoder(engine)
    engine.close()


def _prompts(tok):
    # two prompts of different lengths, 4 rollouts each: the halves pad differently
    a, b = tok("one plus two is")["input_ids"], tok("nine is")["input_ids"]
    return [a] * 4 + [b] * 4


def test_each_rollout_draws_from_its_own_stream(decoder):
    tok, dec = decoder
    gc = GenerationConfig(max_new_tokens=6, do_sample=True, temperature=1.0, eos_token_id=tok.eos_token_id,
                          pad_token_id=tok.pad_token_id)
    rows = _prompts(tok)
    whole = dec.generate(rows, gc, generator=row_generators(1234, range(8))).completions
    # two "ranks": rows 0-4 and 5-7 (a split inside the first group), each with its rows' own streams
    first = dec.generate(rows[:5], gc, generator=row_generators(1234, range(0, 5))).completions
    second = dec.generate(rows[5:], gc, generator=row_generators(1234, range(5, 8))).completions
    assert first + second == whole
    assert len({tuple(c) for c in whole}) > 4   # (sampled: the rows differ)
    # the control: the last rows with the first rows' streams sample something else
    other = dec.generate(rows[5:], gc, generator=row_generators(1234, range(0, 3))).completions
    assert other != whole[5:]


def test_a_row_draws_its_token_from_its_distribution():
    p = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    tok = draw(p.expand(4000, -1), row_generators(0, range(4000)))
    freq = torch.bincount(tok, minlength=6) / 4000.0
    assert freq[[0, 2, 5]].sum() == 0   # a token of no mass is never drawn (nor past the last)
    assert torch.allclose(freq, p, atol=0.03)
    again = draw(p.expand(3, -1), row_generators(0, range(3)))
    assert torch.equal(again, tok[:3])   # each row's draw its own generator's, whatever the batch


def test_a_rank_whose_rows_ended_keeps_decoding_in_lockstep(decoder):
    tok, dec = decoder
    row = [tok("two plus two is")["input_ids"]]
    gc = GenerationConfig(max_new_tokens=6, do_sample=True, pad_token_id=tok.pad_token_id, eos_token_id=10 ** 6)
    gen = lambda: row_generators(3, range(1))  # noqa: E731   (the same draws each call)
    free = dec.generate(row, gc, generator=gen()).completions[0]
    k = next(i for i in range(1, len(free)) if free[i] not in free[:i])   # the first new token after the first
    assert k <= 3   # (the premise: it ends the row well before 6 tokens)
    gc.eos_token_id = free[k]
    alone_out = dec.generate(row, gc, generator=gen())
    asked = []
    lockstep = dec.generate(row, gc, generator=gen(), more=lambda going: asked.append(going) or True)   # another rank decodes on
    assert alone_out.completions == lockstep.completions == [free[:k + 1]]
    assert alone_out.stats["passes"] == k + 1 and "filler_passes" not in alone_out.stats
    # one more pass per token the other rank decodes, each asked in turn, the last step not asked
    assert lockstep.stats["passes"] == 6 and lockstep.stats["filler_passes"] == 5 - k
    assert asked == [True] * k + [False] * (5 - k)
    ended = dec.generate(row, gc, generator=gen(), more=lambda going: going)   # every rank done: no filler pass
    assert ended.stats["passes"] == k + 1


def test_sampling_rules_and_slices():
    assert check_rollout_seeds(None, 1, "auto") == "global"
    assert check_rollout_seeds(None, 2, "auto") == "per_rollout"
    with pytest.raises(ValueError, match="needs one process.*per_rollout"):
        check_rollout_seeds("global", 2, "auto")
    with pytest.raises(ValueError, match="generation='resident'.*streamed"):
        check_rollout_seeds(None, 2, "resident")
    with pytest.raises(ValueError, match="rollout_seeds='each'"):
        check_rollout_seeds("each", 1, "auto")
    assert [list(rank_rows(8, r, 2)) for r in range(2)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match="cannot be split over 4 ranks"):
        rank_rows(3, 0, 4)
    d = {"x": torch.arange(6), "y": list("abcdef")}
    before = torch.get_rng_state()
    a, b = seeded_shuffle(d, 7), seeded_shuffle(d, 7)
    assert torch.equal(torch.get_rng_state(), before)   # the global stream untouched
    assert torch.equal(a["x"], b["x"]) and a["y"] == [d["y"][i] for i in a["x"]]
    assert not torch.equal(a["x"], seeded_shuffle(d, 8)["x"])


EVAL_TIMES = ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second")


class _Rank1:
    """Rank 1 of 2 for the gathers: ``all_gather_json`` answers rank 0's value, then its own (as JSON)."""
    world, rank = 2, 1

    def __init__(self, rank0):
        self.rank0 = rank0

    def all_gather_json(self, obj):
        return json.loads(json.dumps([self.rank0, obj]))


def test_gathers_keep_rank_order_and_values_and_a_failed_reward_stops_every_rank():
    mine = torch.tensor([[0.1, -3.25e-7], [float("nan"), 7.0]])
    got = gather_rewards(_Rank1({"error": None, "shape": [2], "v": [[1.5, 2.0]]}), lambda: mine)
    assert got.dtype == torch.float32 and got.shape == (3, 2) and got[0].tolist() == [1.5, 2.0]
    assert torch.equal(got[1:].nan_to_num(-1), mine.nan_to_num(-1))   # exact, None-as-NaN kept
    logps = torch.randn(2, 5)
    out = gather_rows(_Rank1({"shape": [5], "v": torch.ones(1, 5).double().tolist()}), logps)
    assert torch.equal(out[1:], logps) and torch.equal(out[0], torch.ones(5))   # float32 exact through JSON

    def fails():
        raise RewardError("the reward function 'f' raised ValueError")

    # this rank's function failed: every rank raises (here rank 1, naming itself)...
    with pytest.raises(RewardError, match="rank 1: the reward function 'f' raised"):
        gather_rewards(_Rank1({"error": None, "shape": [2], "v": [[1.5, 2.0]]}), fails)
    # ...and so does a rank whose own functions succeeded, naming the one that failed
    with pytest.raises(RewardError, match="rank 0: boom"):
        gather_rewards(_Rank1({"error": "boom", "v": None}), lambda: mine)


def _logs(folder, key="loss"):
    return [r for r in json.loads((folder / "log_history.json").read_text()) if key in r]


def _weights(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "final" / "model.safetensors"))


CASES = [("0.0", "dapo"), ("0.04", "grpo")]


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    """Both cases' two-rank runs, one after the other in one launch (``<loss_type>/``). The dapo run
    (beta 0) saves a checkpoint after every step: the run both the comparison with one process and
    the resume in one process take (saving a checkpoint changes nothing the run trains or logs: the
    comparison holds with them as without)."""
    base = tmp_path_factory.mktemp("grpo-two-ranks")
    check(torchrun(WORKER, str(base / "dapo"), "1", "2", "0.0", "dapo", "1", "--",
                   str(base / "grpo"), "1", "2", "0.04", "grpo", nproc=2, timeout=600))
    return base


@pytest.fixture(scope="module")
def two_ranks_dapo(two_rank_runs):
    return two_rank_runs / "dapo"


@pytest.fixture(scope="module")
def one_process_runs(tmp_path_factory):
    """Both cases' one-process runs (2 x 2 accumulation), one after the other in one process."""
    base = tmp_path_factory.mktemp("grpo-one-process")
    alone(WORKER, *(a for beta, loss_type in CASES for a in ("--", str(base / loss_type), "2", "4", beta, loss_type)),
          timeout=600)
    return base


@pytest.mark.slow
@pytest.mark.xdist_group("tests/trainer/test_grpo_ranks.py")   # on the worker of the module's runs
@pytest.mark.parametrize("beta,loss_type", CASES)
def test_two_ranks_equal_one_process(two_rank_runs, one_process_runs, beta, loss_type):
    # a generation batch of 2 prompts x 4 = 8 rollouts serving 2 optimizer steps of 4 rollouts (old
    # log-probs computed at generation); 4 steps. Two ranks: 2 per device x 1 accumulation x 2 ranks;
    # one process: 2 x 2 accumulation
    two, one = two_rank_runs / loss_type, one_process_runs / loss_type
    gens_two = json.loads((two / "completions.json").read_text())   # 2 generation batches, 2 eval batches
    assert gens_two == json.loads((one / "completions.json").read_text()) and len(gens_two) == 4
    # each rank decoded its half of every batch (8 rollouts, the eval's 4), both the same number of passes
    r0, r1 = (json.loads((two / f"decode-{r}.json").read_text()) for r in range(2))
    assert [s["rows_in"] for s in r0] == [s["rows_in"] for s in r1] == [4, 4, 2, 2]
    assert [s["passes"] for s in r0] == [s["passes"] for s in r1]
    ev_one, ev_two = (_logs(f, "eval_loss") for f in (one, two))
    assert len(ev_one) == len(ev_two) == 1 and ev_one[0].keys() == ev_two[0].keys()
    for k in (k for k in ev_one[0] if k not in EVAL_TIMES):
        assert ev_two[0][k] == pytest.approx(ev_one[0][k], rel=1e-5, abs=1e-7), k
    logs_two, logs_one = _logs(two), _logs(one)
    assert len(logs_two) == len(logs_one) == 4
    for a, b in zip(logs_one, logs_two):
        assert a.keys() == b.keys()
        for k in (k for k in a if k not in NOT_COMPARED):
            assert (b[k] is None) if a[k] is None else b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), k
    assert ("kl" in logs_one[0]) == (beta != "0.0")
    w1, w2 = _weights(one), _weights(two)
    start = tiny_model(tokenizer()).state_dict()
    moved = sum(float((w1[k] - start[k]).norm()) ** 2 for k in w1) ** 0.5
    diff = sum(float((w1[k] - w2[k]).norm()) ** 2 for k in w1) ** 0.5
    assert moved > 0.1 and diff <= 1e-3 * moved


@pytest.mark.slow
def test_a_two_rank_checkpoint_resumes_in_one_process(tmp_path, two_ranks_dapo):
    """Checkpoints of the 2-rank run (every step: step 1 in the middle of a generation batch, its
    stored rollouts the whole batch's; step 2 at its end) resumed by one process at the same
    global batch: the completions, logs and final weights of the 2-rank run."""
    two = two_ranks_dapo
    gens, logs, w2 = json.loads((two / "completions.json").read_text()), _logs(two), _weights(two)
    start = tiny_model(tokenizer()).state_dict()
    moved = sum(float((w2[k] - start[k]).norm()) ** 2 for k in w2) ** 0.5
    # both resumes one after the other in one process
    alone(WORKER, *(a for step in (1, 2) for a in ("--", str(tmp_path / f"one-{step}"), "2", "4", "0.0", "dapo", "0",
                                                   str(two / f"checkpoint-{step}"))), timeout=600)
    for step in (1, 2):
        one = tmp_path / f"one-{step}"
        resumed = json.loads((one / "completions.json").read_text())   # generation 2 and the evaluation's
        assert len(resumed) == 3 and resumed == gens[-3:]
        after = _logs(one)
        assert [r["step"] for r in after] == [1, 2, 3, 4]   # (the history from the checkpoint, then its own)
        for a, b in zip(logs, after):
            for k in (k for k in a if k not in NOT_COMPARED):
                assert (b[k] is None) if a[k] is None else b[k] == pytest.approx(a[k], rel=1e-5, abs=1e-7), k
        w1 = _weights(one)
        assert sum(float((w1[k] - w2[k]).norm()) ** 2 for k in w1) ** 0.5 <= 1e-3 * moved
