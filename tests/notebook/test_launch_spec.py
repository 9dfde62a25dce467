"""What mt.Session(..., nproc_per_node=N) hands its workers: plain files, no pickles, and clear
refusals for what cannot cross a process boundary. No worker processes here."""
import json
import time

import pytest
import torch


def _micro():
    from transformers import AutoModelForCausalLM

    from megatrain_nb.model_configs import preset_config

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(preset_config("micro"))


def _write(tmp_path, **kw):
    from megatrain_nb.notebook.launch_spec import write_spec

    base = dict(model=_micro(), train_dataset=[{"input_ids": list(range(16))}] * 8, args=None, tokenizer=None,
                eval_dataset=None, seq_len=None, loss_fn=None, callbacks=None, engine_options={})
    base.update(kw)
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    return run, write_spec(run, **base)


def test_spec_is_plain_files_and_rebuilds_the_trainer(tmp_path):
    from transformers import TrainingArguments

    from megatrain_nb.notebook.launch_spec import build_from_spec

    model = _micro()
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=7, learning_rate=3e-4, report_to="none",
                             lr_scheduler_type="cosine", seed=11)
    run, spec = _write(tmp_path, model=model, args=args, engine_options={"device": "cpu"})
    files = {p.suffix for p in run.rglob("*") if p.is_file()}
    assert not files & {".bin", ".pt", ".pth", ".pkl"}, files
    assert (run / "model" / "model.safetensors").is_file() and spec["model"]["written"]
    assert spec["args"]["max_steps"] == 7 and spec["args"]["lr_scheduler_type"] == "cosine"
    assert "per_device_train_batch_size" not in spec["args"]          # only what differs from the defaults
    assert json.loads((run / "spec.json").read_text()) == spec
    (trainer, _tok), _ = build_from_spec(run)
    try:
        assert trainer.args.max_steps == 7 and trainer.args.learning_rate == 3e-4 and trainer.args.seed == 11
        assert len(trainer.train_dataset) == 8
        for name, p in model.named_parameters():
            if name in dict(trainer.engine.named_parameters()):
                assert torch.equal(dict(trainer.engine.named_parameters())[name], p.detach())
                break
    finally:
        trainer.close()


def test_what_cannot_reach_the_workers_is_refused_with_a_reason(tmp_path):
    import datasets
    from transformers import AutoModelForCausalLM

    from megatrain_nb.notebook.launch_spec import LaunchError
    from megatrain_nb.model_configs import preset_config

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(preset_config("micro"))
    with pytest.raises(LaunchError, match="meta device"):
        _write(tmp_path, model=meta)
    with pytest.raises(LaunchError, match="by import"):
        _write(tmp_path, loss_fn=lambda logits, labels: logits.sum())
    with pytest.raises(LaunchError, match="cannot be imported"):
        _write(tmp_path, callbacks=["no_such_module:Thing"])
    it = datasets.Dataset.from_list([{"input_ids": [1, 2, 3]}]).to_iterable_dataset()
    with pytest.raises(LaunchError, match="iterable-only"):
        _write(tmp_path, train_dataset=it)
    with pytest.raises(LaunchError, match="offload_dir"):
        _write(tmp_path, engine_options={"offload_dir": object()})
    with pytest.raises(ValueError, match="nproc_per_node=0"):
        import megatrain_nb as mt

        mt.Session(_micro(), train_dataset=[{"input_ids": [1, 2, 3]}], nproc_per_node=0)


def test_callbacks_and_loss_by_import_path(tmp_path):
    from megatrain_nb.notebook.launch_spec import import_ref
    from megatrain_nb.trainer.checkpoint import read_json

    assert import_ref(read_json, "loss_fn") == "megatrain_nb.trainer.checkpoint:read_json"
    assert import_ref("megatrain_nb.trainer.checkpoint:read_json", "loss_fn").endswith(":read_json")


def test_attach_names_the_runs_there_are(tmp_path):
    import megatrain_nb as mt

    with pytest.raises(LookupError, match=r"no run named 'ghost' on this machine \(runs: none\)"):
        mt.Session.attach("ghost")


def test_run_commands_are_checked():
    from functools import partial

    from megatrain_nb.commands import CommandError, check_command

    validate_run_command = partial(check_command, ranks=True)   # what a run's inbox takes

    assert validate_run_command("checkpoint", None) == ("checkpoint", None)
    assert validate_run_command("checkpoint", "/tmp/x") == ("checkpoint", "/tmp/x")
    assert validate_run_command("stop", True) == ("stop", True)
    assert validate_run_command("lr", "1e-4") == ("lr", 1e-4)
    for bad in (("checkpoint", 3), ("checkpoint", "a\0b"), ("lr", -1), ("reboot", None)):
        with pytest.raises(CommandError):
            validate_run_command(*bad)


def test_root_cause_names_the_rank_torchrun_saw_fail_first():
    from megatrain_nb.notebook.remote import agent_failures, root_cause

    out = """[1]:
  time      : 2026-12-01_08:00:01
  host      : box
  rank      : 0 (local_rank: 0)
  exitcode  : -15 (pid: 11) SIGTERM
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-01_08:00:00
  host      : box
  rank      : 1 (local_rank: 1)
  exitcode  : 9 (pid: 12)
  error_file: <N/A>"""
    assert root_cause(out) == (1, "9")
    assert agent_failures(out) == {0: "-15", 1: "9"}
    assert root_cause("nothing useful") == (None, None)


def test_defaults_are_spelled_out_so_the_controller_finds_the_metrics(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _, spec = _write(tmp_path, model="micro", train_dataset=None)
    assert spec["model"] == {"preset": "micro"} and spec["train"] is None
    assert spec["args"]["output_dir"] == str(tmp_path / "megatrain_outputs" / "micro")
    assert spec["args"]["max_steps"] == 200 and spec["args"]["eval_strategy"] == "steps"
    _, spec = _write(tmp_path)
    assert spec["args"] == {"output_dir": str(tmp_path / "megatrain_outputs")}


def test_every_ranks_memory_reaches_the_view_and_the_tables():
    from megatrain_nb.notebook.run_log import RunLog
    from megatrain_nb.notebook.summary_html import rank_memory_table

    def mem(host):
        return {"device": {"used_bytes": 0, "peak_bytes": 0}, "host": {"used_bytes": host, "peak_bytes": 2 * host}}

    log = RunLog()
    log.add_record({"step": 1, "loss": 2.0, "memory": mem(1 << 20), "rank_memory": [mem(1 << 20), mem(3 << 20)]})
    log.add_record({"step": 2, "loss": 1.9})
    view = log.view()
    assert len(view.rank_memory) == 2
    table = rank_memory_table(view)
    assert "rank 0" in table and "rank 1" in table and "3.0 MiB" in table and "6.0 MiB" in table
    assert rank_memory_table(RunLog().view()) == ""


# ------------------------------------------------------------------ issue 25: launch folders left behind
_KERNEL = """
import os, signal, sys
import megatrain_nb as mt
s = mt.Session("micro", nproc_per_node=2)   # workers start at train(): none here
print(s.run_dir, flush=True)
if sys.argv[1] == "die":
    os.kill(os.getpid(), signal.SIGKILL)
if sys.argv[1] == "hang":
    import time; time.sleep(120)
"""


def _kernel(tmp_path, mode):
    import os
    import subprocess
    import sys
    from pathlib import Path

    repo = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "TMPDIR": str(tmp_path),
           "PYTHONPATH": os.pathsep.join([repo, os.environ.get("PYTHONPATH", "")])}
    p = subprocess.Popen([sys.executable, "-c", _KERNEL, mode], stdout=subprocess.PIPE, text=True, env=env)
    path = p.stdout.readline().strip()
    assert path.startswith(str(tmp_path / "megatrain-launch-")), path
    return p, path


def test_a_kernel_that_exits_without_close_leaves_no_launch_folder(tmp_path):
    import os

    p, path = _kernel(tmp_path, "exit")
    assert p.wait(timeout=120) == 0
    assert not os.path.exists(path)


def test_a_killed_kernels_launch_folder_is_reclaimed_at_the_next_start(tmp_path):
    import os
    import signal

    from megatrain_nb.notebook.launch_spec import make_run_dir

    live, live_path = _kernel(tmp_path, "hang")
    try:
        dead, dead_path = _kernel(tmp_path, "die")
        assert dead.wait(timeout=120) == -signal.SIGKILL and os.path.isdir(dead_path)
        with pytest.warns(UserWarning, match=rf"reclaimed 1 launch folder.*{os.path.basename(dead_path)}"):
            mine = make_run_dir(tmp_path)
        assert not os.path.exists(dead_path) and os.path.isdir(live_path) and mine.is_dir()
        assert (mine.stat().st_mode & 0o777) == 0o700
        # a folder a live process still names (workers finishing after their kernel died) is kept
        orphan = tmp_path / (os.path.basename(dead_path) + "x")
        orphan.mkdir()
        import subprocess
        import sys
        user = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(orphan)])
        try:
            from megatrain_nb.engine.tiers.reclaim import reclaim
            from megatrain_nb.notebook.launch_spec import folder_in_use

            deadline = time.monotonic() + 20   # (a loaded machine: the child's command line shows once it runs)
            while not folder_in_use(orphan) and time.monotonic() < deadline and user.poll() is None:
                time.sleep(0.1)
            assert folder_in_use(orphan), user.poll()
            assert reclaim(str(tmp_path), label="launch-", in_use=folder_in_use) == []
            assert orphan.is_dir()
        finally:
            user.kill()
            user.wait(timeout=30)
    finally:
        live.kill()
        live.wait(timeout=30)

def test_unusable_args_are_refused_before_any_worker_starts(tmp_path):
    from megatrain_nb.trainer.args import UnsupportedArgumentError

    with pytest.raises(UnsupportedArgumentError, match="per_device_train_batch_size=0"):
        _write(tmp_path, args={"output_dir": str(tmp_path / "o"), "per_device_train_batch_size": 0})
    with pytest.raises(UnsupportedArgumentError, match=r"did you mean 'learning_rate'"):
        _write(tmp_path, args={"output_dir": str(tmp_path / "o"), "learnig_rate": 1e-4})


def test_the_first_failing_rank_is_named_and_how():
    from megatrain_nb.notebook.rank_watch import describe_death, first_failure

    reset = {"rank": 0, "pid": 10, "type": "RuntimeError", "message": "gloo: Connection reset by peer", "time": 100.3}
    # rank 1 was SIGKILLed while memory was near its limit; rank 0's error followed from it
    rank, how, then = first_failure([reset], {1: {"pid": 11, "exit_code": "-9", "gone_at": 100.35, "memory": 0.97}})
    assert rank == 1 and how == "rank 1 (pid 11) was killed (signal 9, SIGKILL) — out of memory? (memory was at " \
                                 "97% of its limit just before)"
    assert then == ["rank 0 (pid 10) failed: RuntimeError: gloo: Connection reset by peer"]
    # memory far from the limit: no OOM guess
    assert "out of memory?" not in describe_death(1, 11, "-9", 0.3)
    assert "from outside the run" in describe_death(1, 11, "-9", 0.3)
    # an exception first, a rank that vanished long after: the exception is the cause
    boom = {"rank": 1, "pid": 11, "type": "ValueError", "message": "boom", "time": 100.0}
    rank, how, then = first_failure([boom], {0: {"pid": 10, "exit_code": None, "gone_at": 130.0, "memory": None}})
    assert rank == 1 and how == "rank 1 (pid 11) failed: ValueError: boom" and "rank 0" in then[0]
    # only errors: the earliest
    rank, how, _ = first_failure([boom, reset], {})
    assert rank == 1
    assert describe_death(2, None, "9", None) == "rank 2 died (exit code 9) without raising (killed? out of memory?)"
    assert describe_death(2, 5, "-11", None).startswith("rank 2 (pid 5) was killed by signal 11 (SIGSEGV)")


def test_an_sft_config_reaches_the_workers_as_an_sft_trainer(tmp_path):
    """mt.Session(..., args=SFTConfig(...), nproc_per_node=N): the workers build mt.SFTTrainer with
    the same SFTConfig (issue 20), not a plain Trainer with TrainingArguments."""
    pytest.importorskip("trl")
    import sys
    from pathlib import Path

    from datasets import Dataset

    from megatrain_nb.notebook.launch_spec import build_from_spec
    from megatrain_nb.trainer.sft import SFTTrainer

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from trainer.sft_helpers import CONVS, sft_config, tiny_llama, tokenizer

    tok = tokenizer()
    args = sft_config(tmp_path / "out", assistant_only_loss=True, packing=True, max_length=96, max_steps=5,
                      learning_rate=3e-4)
    run, spec = _write(tmp_path, model=tiny_llama(len(tok)), args=args, tokenizer=tok,
                       train_dataset=Dataset.from_list(CONVS[:12]), engine_options={"device": "cpu"})
    assert spec["args_class"] == "SFTConfig" and spec["args"]["assistant_only_loss"] is True
    assert spec["args"]["max_length"] == 96 and "dataset_text_field" not in spec["args"]   # only what differs
    (trainer, _tok), _ = build_from_spec(run)
    try:
        assert isinstance(trainer, SFTTrainer) and type(trainer.args).__name__ == "SFTConfig"
        for name in ("assistant_only_loss", "packing", "max_length", "max_steps", "learning_rate", "bf16",
                     "per_device_train_batch_size", "packing_strategy", "output_dir"):
            assert getattr(trainer.args, name) == getattr(args, name), name
        assert trainer.padding_free and len(trainer.train_dataset) > 0
    finally:
        trainer.close()


def test_an_sft_config_that_cannot_apply_is_refused_before_any_worker_starts(tmp_path):
    pytest.importorskip("trl")
    from trl import SFTConfig

    from megatrain_nb.trainer.sft import SFTArgumentError

    from megatrain_nb.trainer.args import UnsupportedArgumentError

    args = SFTConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, router_aux_loss_coef=0.5)
    with pytest.raises(SFTArgumentError, match="router_aux_loss_coef"):
        _write(tmp_path, args=args)
    args = SFTConfig(output_dir=str(tmp_path / "out"), use_cpu=True, bf16=False, use_liger_kernel=True)
    with pytest.raises(UnsupportedArgumentError, match="use_liger_kernel"):
        _write(tmp_path, args=args)


def test_a_branch_needs_a_snapshot_and_known_fields(tmp_path):
    """A fork of a multi-process run: the spec's branch (BranchStart fields), from a snapshot."""
    from megatrain_nb.notebook.launch_spec import LaunchError, branch_start

    with pytest.raises(LaunchError, match="starts from a snapshot"):
        _write(tmp_path, branch={"new_run": True})
    with pytest.raises(LaunchError, match=r"\['colour'\] are not BranchStart fields"):
        _write(tmp_path, branch={"colour": 1}, resume=str(tmp_path))
    _, spec = _write(tmp_path, branch={"new_run": True, "rebuild_schedule": True}, resume=str(tmp_path))
    start = branch_start(spec)
    assert start.new_run and start.rebuild_schedule and not start.restart_data
    _, plain = _write(tmp_path)
    assert plain["branch"] is None and branch_start(plain) is None


def test_a_dpo_config_reaches_the_workers_as_a_dpo_trainer(tmp_path):
    """mt.Session(..., args=DPOConfig(...), nproc_per_node=N): the workers build mt.DPOTrainer with
    the same DPOConfig (issue 30); a field that cannot apply is refused before any worker starts."""
    pytest.importorskip("trl")
    import sys
    from pathlib import Path

    from datasets import Dataset

    from megatrain_nb.notebook.launch_spec import build_from_spec
    from megatrain_nb.trainer.dpo import DPOTrainer

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from trainer.dpo_helpers import dpo_config, pairs, tiny_llama, tokenizer

    tok = tokenizer()
    args = dpo_config(tmp_path / "out", beta=0.3, loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5], max_steps=3)
    run, spec = _write(tmp_path, model=tiny_llama(len(tok)), args=args, tokenizer=tok,
                       train_dataset=Dataset.from_list(pairs(6)), engine_options={"device": "cpu"})
    assert spec["args_class"] == "DPOConfig" and spec["args"]["beta"] == 0.3
    assert "label_smoothing" not in spec["args"]   # only what differs from DPOConfig's defaults
    (trainer, _tok), _ = build_from_spec(run)
    try:
        assert isinstance(trainer, DPOTrainer) and type(trainer.args).__name__ == "DPOConfig"
        for name in ("beta", "loss_type", "loss_weights", "max_length", "max_steps", "learning_rate", "bf16",
                     "per_device_train_batch_size", "output_dir"):
            assert getattr(trainer.args, name) == getattr(args, name), name
        assert trainer.settings.beta == 0.3 and len(trainer.train_dataset) == 6
    finally:
        trainer.close()
    with pytest.raises(ValueError, match="sync_ref_model"):
        _write(tmp_path, args=dpo_config(tmp_path / "out", sync_ref_model=True))
