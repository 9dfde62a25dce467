"""A Session whose run recovers by itself (on_nonfinite="rewind"): each recovery is a branch of
its run tree, a "recovery" event (dashboard marker, %megatrain status) and the history reads
one continuous run."""
import torch

from nb_fakes import close_sessions


def test_a_session_recovers_and_shows_each_recovery(tmp_path):
    from transformers import TrainingArguments

    from megatrain_nb.notebook import Session
    from megatrain_nb.notebook.magics import status_line
    from recovery_loss import MARK, _dataset, micro_model, nan_on_marked_rows

    a = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=10, per_device_train_batch_size=1,
                          learning_rate=3e-3, lr_scheduler_type="constant", max_grad_norm=1.0, logging_steps=1,
                          report_to="none", save_strategy="no", disable_tqdm=True, use_cpu=True)
    torch.manual_seed(0)
    s = Session(micro_model(), train_dataset=_dataset(marked=(3, 7)), args=a, loss_fn=nan_on_marked_rows,
                on_nonfinite="rewind", name="rec")
    try:
        s.train(block=True)
        assert s.state == "finished" and s.step == 10
        assert [r["step"] for r in s.history] == list(range(1, 11))
        rec = [e for e in s.events if e["kind"] == "recovery"]
        assert len(rec) == 2 and all(e["skipped_window"] for e in rec)
        runs = {n["run_id"]: n for n in s.explorer.tree()}
        assert len(runs) == 3   # the root and a branch per recovery
        assert "recovery 2/3" in status_line(s)
        assert MARK == 7
    finally:
        close_sessions([s], timeout=30)
