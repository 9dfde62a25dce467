"""A multi-process Session of a GRPO run (``mt.Session(..., args=GRPOConfig, reward_funcs=...,
nproc_per_node=2)``): the reward functions reach the workers by import path (a reward model by its
folder), the GRPOConfig's fields as JSON with its generation batch derived again from the ranks;
what cannot reach them is refused before any worker starts. Slow: the Session's two ranks end
where one process at the same global batch ends (tests/trainer/grpo_ranks_worker.py)."""
import json

import pytest

trl = pytest.importorskip("trl")

from megatrain_nb.notebook.launch_spec import LaunchError, write_spec  # noqa: E402

from ..distributed.launch import alone, controller_env  # noqa: E402
from .test_grpo_parity import config, prompts, reward_short, reward_yes, tiny_model, tokenizer  # noqa: E402
from .test_grpo_ranks import WORKER, _weights  # noqa: E402


def _spec(tmp_path, args, rewards):
    return write_spec(tmp_path, model="micro", train_dataset=prompts(), args=args, tokenizer=None, eval_dataset=None,
                      seq_len=None, loss_fn=None, callbacks=None, engine_options={"reward_funcs": rewards})


def test_the_spec_carries_the_reward_functions_and_the_grpo_config(tmp_path):
    from transformers import TrainingArguments

    args = config(tmp_path / "run", per_device_train_batch_size=2, steps_per_generation=2, beta=0.04)
    spec = _spec(tmp_path, args, [reward_yes, reward_short])
    assert spec["args_class"] == "GRPOConfig"
    assert spec["reward_funcs"] == [{"ref": "tests.trainer.test_grpo_parity:reward_yes"},
                                    {"ref": "tests.trainer.test_grpo_parity:reward_short"}]
    assert "reward_funcs" not in spec["engine_options"]
    # the generation batch is derived again in the workers (from their ranks); an explicit
    # steps_per_generation stays, the accumulation's default does not
    assert "generation_batch_size" not in spec["args"] and spec["args"]["steps_per_generation"] == 2
    assert spec["args"]["beta"] == 0.04
    plain = _spec(tmp_path, config(tmp_path / "run", gradient_accumulation_steps=2), reward_yes)["args"]
    assert "steps_per_generation" not in plain and "generation_batch_size" not in plain
    assert json.loads((tmp_path / "spec.json").read_text())["reward_funcs"] == [
        {"ref": "tests.trainer.test_grpo_parity:reward_yes"}]
    with pytest.raises(LaunchError, match="must reach the worker processes by import"):
        _spec(tmp_path, args, [lambda completions, **kw: [0.0] * len(completions)])
    with pytest.raises(LaunchError, match="as a local folder: save_pretrained"):
        _spec(tmp_path, args, [tiny_model(tokenizer())])
    with pytest.raises(LaunchError, match="give the Session args=trl.GRPOConfig"):
        _spec(tmp_path, TrainingArguments(output_dir=str(tmp_path / "x")), [reward_yes])
    with pytest.raises(LaunchError, match="pass reward_funcs="):
        _spec(tmp_path, args, None)
    with pytest.raises(ValueError, match="use_vllm"):
        _spec(tmp_path, config(tmp_path / "run", use_vllm=True), [reward_yes])


@pytest.mark.slow
def test_a_grpo_session_on_two_ranks_ends_where_one_process_ends(tmp_path, monkeypatch):
    import megatrain_nb as mt

    controller_env(tmp_path, monkeypatch)
    tok = tokenizer()
    folder = tmp_path / "policy"
    tiny_model(tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    # the worker's two-rank run: 2 per device x accumulation 1 x steps_per_generation 2 x 2 ranks
    args = config(tmp_path / "two", per_device_train_batch_size=2, steps_per_generation=2, max_steps=4,
                  max_completion_length=6)
    s = mt.Session(str(folder), train_dataset=prompts(), args=args, reward_funcs=[reward_yes, reward_short],
                   nproc_per_node=2, device="cpu")
    try:
        s.train()
        assert s.wait(timeout=400) == "finished", (s.state, getattr(s, "worker_log", None))
        last = s.run_log.last_record()
    finally:
        s.close()
    alone(WORKER, str(tmp_path / "one"), "2", "4", timeout=400)   # one process: accumulation 2 x 4 per generation
    w1, w2 = _weights(tmp_path / "one"), _weights_at(tmp_path / "two")
    start = tiny_model(tok).state_dict()
    moved = sum(float((w1[k] - start[k]).norm()) ** 2 for k in w1) ** 0.5
    diff = sum(float((w1[k] - w2[k]).norm()) ** 2 for k in w1) ** 0.5
    assert moved > 0.1 and diff <= 1e-3 * moved
    # the dashboard's record of the last step: the latest generation batch's rewards, as one process's
    steps = [json.loads(x) for x in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines()]
    one = [r for r in steps if "reward" in r][-1]
    assert last["step"] == one["step"] == 4
    for k in ("reward", "reward_std", "completion_length", "rewards/reward_yes/mean", "loss"):
        assert last[k] == pytest.approx(one[k], rel=1e-5, abs=1e-7), k

def _weights_at(folder):
    from safetensors.torch import load_file

    return load_file(str(folder / "model.safetensors"))


@pytest.mark.slow   # (three Sessions' launch folders: ~10 s)
def test_a_multi_process_sessions_displays_know_what_its_ranks_train(tmp_path, monkeypatch):
    """The dashboard picks its GRPO (or DPO) panel by what the ranks train, which a multi-process
    Session's kernel knows from the arguments it wrote (no trainer lives in the kernel), and an
    attached one from rank 0's heartbeat."""
    import megatrain_nb as mt
    from megatrain_nb.notebook.grpo_view import is_grpo_run
    from megatrain_nb.notebook.preference_view import is_preference_run
    from megatrain_nb.notebook.remote import ProcessRun
    from megatrain_nb.notebook.run_state import RunState
    from trl import DPOConfig

    controller_env(tmp_path, monkeypatch)
    grpo = mt.Session("micro", train_dataset=prompts(), args=config(tmp_path / "g"), reward_funcs=[reward_yes],
                      nproc_per_node=2, device="cpu")   # (the workers start at train(): none here)
    dpo_args = DPOConfig(output_dir=str(tmp_path / "d"), report_to="none", use_cpu=True)
    dpo = mt.Session("micro", args=dpo_args, nproc_per_node=2, device="cpu")
    plain = mt.Session("micro", nproc_per_node=2, device="cpu")
    try:
        assert [s.training_kind for s in (grpo, dpo, plain)] == ["grpo", "dpo", "plain"]
        assert [is_grpo_run(s) for s in (grpo, dpo, plain)] == [True, False, False]
        assert [is_preference_run(s) for s in (grpo, dpo, plain)] == [False, True, False]
    finally:
        for s in (grpo, dpo, plain):
            s.close()
    beat = {"id": "x", "world_size": 2, "training_kind": "grpo", "output_dir": str(tmp_path / "a")}
    assert ProcessRun.attaching(RunState("x"), beat).training_kind == "grpo"
    assert ProcessRun.attaching(RunState("x"), dict(beat, training_kind=None)).training_kind is None
