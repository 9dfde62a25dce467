"""A diverged run says so plainly in the Session and its header (the dashboard's too)."""
import pytest

from megatrain_nb.engine.updates.finite import NonFiniteError
from megatrain_nb.notebook.run_log import RunView  # noqa: F401 - the header's input type
from megatrain_nb.notebook.summary_html import header_html


def test_session_and_header_show_the_divergence(fake_session):
    def diverge(step):
        if step == 7:
            raise NonFiniteError(7, float("nan"), None)
        return 1.0

    s = fake_session(total_steps=20, loss_fn=diverge)
    s.train()
    with pytest.raises(NonFiniteError, match="non-finite loss/gradient at step 7"):
        s.wait(timeout=10)
    assert s.diverged and s.state == "failed"
    assert s.summary()["diverged_at"] == 7
    page = header_html(s, s.run_log.view())
    assert "diverged at step 7" in page


def test_an_ordinary_failure_is_not_called_a_divergence(fake_session):
    def boom(step):
        raise ValueError("other")

    s = fake_session(total_steps=5, loss_fn=boom)
    s.train()
    with pytest.raises(ValueError):
        s.wait(timeout=10)
    assert not s.diverged and s.summary()["diverged_at"] is None
    assert "diverged" not in header_html(s, s.run_log.view())
