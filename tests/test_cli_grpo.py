"""run.yaml's grpo: section (issue 48 item 5): examples/grpo.yaml trains for 2 steps on the shipped
arithmetic task; reward functions named module:function, file.py:function or by a shipped name;
bad names refused with what to write."""
import json
from pathlib import Path

import pytest

pytest.importorskip("trl")

from megatrain_nb.cli import main  # noqa: E402
from megatrain_nb.cli.config import UsageError  # noqa: E402
from megatrain_nb.cli.train_grpo import reward_function  # noqa: E402
from megatrain_nb.rewards import arithmetic_correct  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "grpo.yaml"


def test_reward_functions_are_named_three_ways(tmp_path):
    assert reward_function("arithmetic_correct", tmp_path) is arithmetic_correct
    assert reward_function("megatrain_nb.rewards:arithmetic_correct", tmp_path) is arithmetic_correct
    (tmp_path / "mine.py").write_text("def short(completions, **kw):\n    return [-len(c) for c in completions]\n")
    assert reward_function("mine.py:short", tmp_path)(["ab", "c"]) == [-2, -1]
    for bad, words in [("nope", "not a shipped reward"), ("megatrain_nb.rewards:nope", "has no function 'nope'"),
                       ("no_such_module_x:f", "cannot load"), ("missing.py:f", "cannot load"), (3, "not a name")]:
        with pytest.raises(UsageError, match=words):
            reward_function(bad, tmp_path)


@pytest.mark.slow
def test_examples_grpo_yaml_trains_two_steps(tmp_path, capsys):
    assert main(["train", "--config", str(EXAMPLE), "--max-steps", "2", "--output-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "built-in arithmetic prompts, 80 prompts x 4 completions" in out and "reward: " in out
    assert "\ngeneration: resident copy (transformers' generate)" in out   # (the run header's generation: line)
    recs = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in recs if "reward" in r and "event" not in r]
    assert [r["step"] for r in steps] == [1, 2]
    for r in steps:
        assert r["generation_s"] > 0 and 0.0 <= r["rewards/arithmetic_correct/mean"] <= 1.0
        assert r["reward"] == r["rewards/arithmetic_correct/mean"] + r["rewards/answers_with_a_number/mean"]
    assert (tmp_path / "config.json").is_file()


def test_a_grpo_section_without_rewards_is_refused(tmp_path, capsys):
    cfg = tmp_path / "run.yaml"
    cfg.write_text("preset: micro\ngrpo:\n  num_generations: 4\n")
    assert main(["train", "--config", str(cfg), "--output-dir", str(tmp_path / "out")]) == 2
    assert "grpo.reward_funcs: name at least one reward function" in capsys.readouterr().err
