"""The predicted step against the measured one in ``%megatrain status`` and the dashboard
(notebook/prediction_view.py), on made-up rates given to the engine: nothing is timed, and no
test reads this machine's cached measurement."""
import numpy as np
import pytest

from nb_fakes import close_sessions


def made_up_rates():
    from megatrain_nb.engine.planning.rates import MachineRates

    return MachineRates(device="test", cores=4, h2d_pinned=1e10, d2h_pinned=1e10, h2d_pageable=1e10,
                        d2h_pageable=1e10, matmul_flops=1e11, attention_flops=1e11, disk_read=1e9, disk_write=1e9,
                        adamw_per_thread=1e9, codec_per_thread={}, source="made-up")


@pytest.fixture
def session(tmp_path, monkeypatch):
    import datasets
    from transformers import AutoModelForCausalLM, TrainingArguments

    from megatrain_nb.model_configs import preset_config
    from megatrain_nb.notebook import Session

    monkeypatch.setenv("MEGATRAIN_NB_CACHE", str(tmp_path / "cache"))   # never this machine's measurement
    rng = np.random.default_rng(0)
    ds = datasets.Dataset.from_dict({"input_ids": rng.integers(0, 512, size=(32, 16)).tolist()})
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=3, per_device_train_batch_size=2,
                             report_to="none", save_strategy="no", disable_tqdm=True, use_cpu=True)
    s = Session(AutoModelForCausalLM.from_config(preset_config("micro")), train_dataset=ds, args=args,
                name="run-a", offload_dir=str(tmp_path / "disk"))
    yield s
    close_sessions([s], timeout=30)


def test_status_and_dashboard_show_the_predicted_step_then_each_phase_measured(ip, session, capsys):
    from megatrain_nb.engine.planning.prediction import fmt_seconds
    from megatrain_nb.notebook.dashboard import Dashboard

    s = session
    ip.run_line_magic("megatrain", "status")
    assert "predicted step" not in capsys.readouterr().out   # no rates given, none cached: nothing shown
    s.trainer.engine.rates = made_up_rates()
    pred = s.prediction
    ip.run_line_magic("megatrain", "status")
    out = capsys.readouterr().out
    assert f"predicted step {fmt_seconds(pred.step_seconds)}; bottleneck: {pred.bottleneck}" in out
    assert "measured per phase once 2 steps ran" in out
    d = Dashboard(s)
    d.refresh(force=True)
    assert "mtnb-dash-prediction" in d.links.value and "measured" not in d.links.value

    s.train(block=True, dashboard=False)
    assert s.state == "finished"
    report = s.trainer.measured_vs_predicted()
    assert report["steps"] == 2 and report["prediction"].step_seconds == pred.step_seconds
    ip.run_line_magic("megatrain", "status")
    out = capsys.readouterr().out
    assert "predicted vs measured per step (over 2 steps, the first left out)" in out
    for name, p, m in report["rows"]:   # each row: the prediction's number beside the telemetry's
        row = next(line for line in out.splitlines() if line.startswith(f"  {name} "))
        assert fmt_seconds(p) in row and (m is None or fmt_seconds(m) in row), row
    assert {"step", "compute", "optimizer", "disk read", "disk write", "waits"} <= {r[0] for r in report["rows"]}
    assert (f"prediction: {report['difference']}" in out) == (report["difference"] is not None)
    d.refresh(force=True)
    assert f"measured {fmt_seconds(report['measured']['step'])}" in d.links.value
    assert ("mtnb-dash-prediction-off" in d.links.value) == (report["difference"] is not None)


def test_the_dashboards_block_carries_the_difference_line():
    from megatrain_nb.engine.planning.prediction_check import comparison_rows, difference_line
    from megatrain_nb.notebook.prediction_view import prediction_html, status_lines
    from tests.engine.test_prediction import predict, rates

    p, *_ = predict(rates(disk_read=1e7, disk_write=1e7), offload_dir="/nowhere", offload_params=True)
    compute = p.phases["forward"] + p.phases["backward"] + p.phases["recompute"]
    slow = {"step": p.step_seconds * 2, "disk_read": p.phases["disk_read"] * 3, "disk_write": p.phases["disk_write"],
            "optimizer": 0.0, "waits": {"disk": p.step_seconds * 2 - compute}}
    report = {"prediction": p, "measured": slow, "steps": 4, "rows": comparison_rows(p, slow),
              "difference": difference_line(p, slow)}
    block = prediction_html(report, "gray")
    assert "+100%" in block and "mtnb-dash-prediction-off" in block and "disk read" in block
    lines = status_lines(report)
    assert lines[-1] == f"prediction: {report['difference']}" and "over 4 steps" in lines[1]
    assert prediction_html(None, "gray") == "" and status_lines(None) == []
    close = dict(slow, step=p.step_seconds * 1.1, disk_read=p.phases["disk_read"])
    assert "+10%" in prediction_html(dict(report, measured=close, difference=None), "gray")
    assert "mtnb-dash-prediction-off" not in prediction_html(dict(report, measured=close, difference=None), "gray")
