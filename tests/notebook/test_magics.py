"""%megatrain in an in-process IPython shell (the real kernel: test_kernel.py)."""
import pytest

from megatrain_nb.notebook import registry
from nb_fakes import wait_until


@pytest.fixture
def no_sessions(monkeypatch):
    monkeypatch.setattr(registry, "_current", None)
    monkeypatch.setattr(registry, "_by_name", registry.weakref.WeakValueDictionary())


def test_helpful_message_when_there_is_no_session(ip, no_sessions, capsys):
    ip.run_line_magic("megatrain", "status")
    out = capsys.readouterr().out
    assert "No megatrain session" in out and "session.train()" in out
    ip.run_line_magic("megatrain", "pause -s nope")
    assert "no session named 'nope'" in capsys.readouterr().out
    ip.run_line_magic("megatrain", "")
    assert "Usage" in capsys.readouterr().out
    ip.run_line_magic("megatrain", "frobnicate")
    assert "unknown command 'frobnicate'" in capsys.readouterr().out


def test_controls_act_on_the_current_session(ip, fake_session, capsys):
    s = fake_session(total_steps=3000, step_time=0.003, lr=1e-3)
    s.train()
    assert wait_until(lambda: s.step >= 3)
    ip.run_line_magic("megatrain", "pause")
    assert "paused at step" in capsys.readouterr().out
    held = s.step
    ip.run_line_magic("megatrain", "lr 5e-4")
    assert "learning rate 0.0005" in capsys.readouterr().out
    ip.run_line_magic("megatrain", "lr fast")
    assert "%megatrain lr='fast': must be a finite number > 0 and <= 10" in capsys.readouterr().out
    ip.run_line_magic("megatrain", "lr 1e10")   # the Trainer's, the Session's and the sidebar's rule
    assert "<= 10 (the optimizer's step size; above 10 is implausibly large" in capsys.readouterr().out
    ip.run_line_magic("megatrain", "lr 0")
    assert "must be a finite number > 0" in capsys.readouterr().out
    ip.run_line_magic("megatrain", "status")
    out = capsys.readouterr().out
    assert "paused" in out and f"step {held}/3000" in out and "lr" in out
    ip.run_line_magic("megatrain", "resume")
    assert "resumed" in capsys.readouterr().out
    ip.run_line_magic("megatrain", "stop")
    assert "stopped at step" in capsys.readouterr().out
    assert [e["kind"] for e in s.events] == ["pause", "lr", "resume", "stop"]
    assert {e["source"] for e in s.events} == {"magic"}
    ip.run_line_magic("megatrain", "pause")
    assert "stopped: nothing to pause" in capsys.readouterr().out


def test_named_session_report_and_sessions_list(ip, fake_session, capsys, tmp_path):
    a = fake_session(name="alpha", total_steps=10)
    fake_session(name="beta", total_steps=10)
    a.train(block=True)
    ip.run_line_magic("megatrain", f"report {tmp_path / 'a.html'} --session alpha")
    assert "report written" in capsys.readouterr().out
    assert (tmp_path / "a.html").is_file()
    ip.run_line_magic("megatrain", "sessions")
    out = capsys.readouterr().out
    assert "* alpha: finished" in out and "beta: idle" in out


def test_estimate_shows_the_memory_table(ip, capsys):
    ip.run_line_magic("megatrain", "estimate llama-7b --vram 24 --ram 64 --disk 1000")
    out = capsys.readouterr().out
    assert "llama-7b" in out
    ip.run_line_magic("megatrain", "estimate llama-7b --vram lots")
    assert "takes a number of GiB" in capsys.readouterr().out


def test_dashboard_magic_displays_the_widget(ip, fake_session, monkeypatch):
    from megatrain_nb.notebook.dashboard import Dashboard

    shown = []
    monkeypatch.setattr(ip.display_pub, "publish", lambda data, *a, **k: shown.append(data))
    s = fake_session(total_steps=5)
    s.train(block=True)
    ip.run_line_magic("megatrain", "dashboard")
    d = s.dashboard()  # the session keeps one widget: the one the magic displayed
    assert isinstance(d, Dashboard)
    assert any((x.get("application/vnd.jupyter.widget-view+json") or {}).get("model_id") == d.model_id for x in shown)
    assert "finished" in d.header.value
