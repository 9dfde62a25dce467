"""The GRPO panel (issue 48 item 5): reward (mean and per function), KL (beta != 0), completion
length and the step's time split, from the records a GRPO run writes; a run that is not GRPO
shows nothing new."""
from megatrain_nb.notebook.grpo_view import (function_names, grpo_html, grpo_parts, grpo_section, grpo_spec,
                                             time_split)
from megatrain_nb.notebook.static_chart import panels_svg


def _records(kl=False, n=5):
    out = []
    for i in range(1, n + 1):
        r = {"step": i, "loss": 0.1, "reward": 0.1 * i, "reward_std": 0.2, "rewards/correct/mean": 0.05 * i,
             "rewards/format/mean": 0.1 * i, "completion_length": 4.0 - 0.1 * i,
             "generation_s": 3.0 if i % 2 else 0.0, "step_time_s": 1.0}
        if kl:
            r["kl"] = 0.001 * i
        out.append(r)
    return out


def test_the_spec_has_reward_per_function_length_and_time_and_kl_only_with_beta():
    spec = grpo_spec(_records())
    titles = [p["title"] for p in spec["panels"]]
    assert titles == ["reward: mean and per function", "completion length (tokens)",
                      "seconds per step: generation vs training"]
    reward = spec["panels"][0]["series"]
    assert [s["name"] for s in reward] == ["reward (weighted sum)", "correct", "format"]
    assert reward[1]["y"] == [0.05 * i for i in range(1, 6)] and reward[0]["x"] == [1, 2, 3, 4, 5]
    assert spec["panels"][2]["series"][0]["y"] == [3.0, 0.0, 3.0, 0.0, 3.0]
    with_kl = grpo_spec(_records(kl=True))
    assert [p["title"] for p in with_kl["panels"]][1] == "KL to the reference"
    assert with_kl["panels"][1]["series"][0]["y"][-1] == 0.005
    assert "<polyline" in panels_svg(with_kl)


def test_the_status_report_and_snapshot_say_it():
    recs = _records(kl=True)
    assert grpo_parts(recs[0]) == ["reward 0.1", "KL 0.001", "completions 3.9 tokens", "generation 75% of the step"]
    assert time_split(recs) == (9.0, 5.0) and function_names(recs) == ["correct", "format"]
    md, spec = grpo_section(recs)
    assert "## Learning from rewards" in md and "| step | reward | correct | format | KL |" in md
    assert "generation: 64% of the run's step time" in md and spec["kind"] == "panels"
    assert grpo_html(recs).startswith("<div><img")


def test_a_run_that_is_not_grpo_shows_nothing():
    plain = [{"step": 1, "loss": 1.0, "step_time_s": 1.0}, {"step": 2, "loss": 0.9, "rewards/margins": 0.1}]
    assert grpo_parts(plain[0]) == [] and grpo_section(plain) is None and grpo_html(plain) == ""
