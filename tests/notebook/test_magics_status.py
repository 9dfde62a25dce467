"""``%megatrain status`` while another session is open (issue 44 item 10): it said "no session
here yet" once the current session was closed."""
from megatrain_nb.notebook import Session
from megatrain_nb.notebook.magics import megatrain
from tests.trainer.helpers import micro_model, token_dataset


def test_status_names_the_open_sessions_when_the_current_one_was_closed(capsys):
    a = Session(micro_model(), train_dataset=token_dataset(4), name="issue44-open", device="cpu")
    b = Session(micro_model(), train_dataset=token_dataset(4), name="issue44-closed", device="cpu")   # the current one
    try:
        b.close()
        megatrain("status")
        out = capsys.readouterr().out
        assert "No megatrain session here yet" not in out
        assert "no current session" in out and "issue44-open" in out and "issue44-closed" not in out
        assert "%megatrain status -s issue44-open" in out
        megatrain("status -s issue44-open")
        assert "issue44-open" in capsys.readouterr().out
    finally:
        a.close()
        b.close()
