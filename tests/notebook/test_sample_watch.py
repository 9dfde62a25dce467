"""Answers to the sample prompt (``session.set_sample_prompt``): drawn on their own thread at a
step interval, from the weights of the step they are shown with, into the dashboard's samples
panel, the static HTML and the report; a slow sample never queues up work."""
import threading
import time

import pytest
import torch

from nb_fakes import VOCAB, CharTokenizer, wait_until

ASK = [{"role": "user", "content": "ab"}]


class ChatCharTokenizer(CharTokenizer):
    chat_template = "role: content"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False):
        text = "".join(f"{m['role'][0]}{m['content']}" for m in messages)
        return text + ("A" if add_generation_prompt else "")


def _expected(prompt: str, step: int, n: int) -> str:
    """What the stepping fake model answers: each token the last one + 1 + step."""
    out, last = [], ord(prompt[-1]) % VOCAB
    for _ in range(n):
        last = (last + 1 + step) % VOCAB
        out.append(chr(last))
    return "".join(out)


def _stepping(s, calls=None, delay=0.0):
    """The fake engine's "weights" change with the step: its next token is the last + 1 + step."""
    eng = s.engine

    def forward_logits(input_ids, attention_mask=None):
        if calls is not None:
            calls.append(threading.current_thread().name)
        if delay:
            time.sleep(delay)
        logits = torch.zeros(*input_ids.shape, VOCAB)
        logits.scatter_(2, ((input_ids + 1 + eng.step) % VOCAB).unsqueeze(-1), 10.0)
        return logits

    eng.forward_logits = forward_logits


@pytest.fixture
def chat_session(fake_session):
    def make(**kw):
        s = fake_session(**kw)
        s._tokenizer = ChatCharTokenizer()   # the fake session's tokenizer, with a chat template
        return s
    return make


def test_answers_come_at_the_interval_from_that_steps_weights(chat_session):
    s = chat_session(total_steps=40, step_time=0.01)
    calls = []
    _stepping(s, calls)
    s.set_sample_prompt(ASK, every=10, max_new_tokens=3)
    assert wait_until(lambda: len(s.sample_watch.answers()) == 1)   # the answer before training
    s.train()
    s.wait(timeout=30)
    assert wait_until(lambda: any(a["step"] == 40 for a in s.sample_watch.answers()))   # the last weights
    answers = s.sample_watch.answers()
    steps = [a["step"] for a in answers]
    assert steps[0] == 0 and steps[-1] == 40 and steps == sorted(set(steps))
    assert set(steps) <= {0, 10, 20, 30, 40} and len(steps) >= 4
    prompt = s.sample_watch.prompt
    assert prompt == "uabA"
    for a in answers:   # each answer is the one the weights of its step give: shown with the right step
        assert a["answer"] == _expected(prompt, a["step"], 3), a
    assert len({a["answer"] for a in answers}) == len(answers)   # the answers change as it trains
    assert calls and all(n.startswith("mtnb-samples-") for n in calls)   # never the training thread


def test_the_training_thread_never_draws_and_a_slow_sample_does_not_queue_up(chat_session):
    s = chat_session(total_steps=60, step_time=0.002)
    calls = []
    _stepping(s, calls, delay=0.05)   # one answer (4 tokens): 0.2 s, many steps' time
    s.set_sample_prompt(ASK, every=2, max_new_tokens=4)
    s.train()
    s.wait(timeout=60)
    assert wait_until(lambda: s.sample_watch.drawing is None and
                      any(a["step"] == 60 for a in s.sample_watch.answers()), timeout=20)
    assert not s.trainer.threads_seen & set(calls)
    # 30 steps came due; one answer takes 0.2 s, so at most 10 % of the run's time: the answer
    # before training, the one at the end, and few between (the run itself takes ~0.2 s)
    assert len(calls) % 4 == 0 and 2 <= len(calls) // 4 <= 4


def test_keeps_the_last_answers_and_a_new_prompt_starts_a_new_history(chat_session):
    s = chat_session(total_steps=30, step_time=0.03)
    _stepping(s)
    s.sample_watch.keep = 3
    s.set_sample_prompt(ASK, every=1, max_new_tokens=1)
    s.train()
    s.wait(timeout=30)
    assert wait_until(lambda: any(a["step"] == 30 for a in s.sample_watch.answers()))
    assert len(s.sample_watch.answers()) == 3
    s.set_sample_prompt([{"role": "user", "content": "xy"}], every=5, max_new_tokens=2)
    assert wait_until(lambda: len(s.sample_watch.answers()) == 1), (s.sample_watch.answers(), s.sample_watch.drawing)
    assert s.sample_watch.answers()[0] == {**s.sample_watch.answers()[0], "step": 30,
                                           "answer": _expected("uxyA", 30, 2)}
    assert s.generate(max_new_tokens=2, temperature=0) == "uxyA" + _expected("uxyA", 30, 2)


def test_bad_prompts_are_refused_when_set(fake_session, chat_session):
    s = fake_session(total_steps=3)
    with pytest.raises(ValueError, match="chat template"):
        s.set_sample_prompt(ASK)   # the plain character tokenizer has none
    c = chat_session(total_steps=3)
    with pytest.raises(ValueError, match="list of"):
        c.set_sample_prompt("What is two plus three ?")
    with pytest.raises(ValueError, match="every=0"):
        c.set_sample_prompt(ASK, every=0)
    assert c.sample_watch.prompt is None
    c.train(block=True)
    c.close()   # released: nothing to answer with
    with pytest.raises(RuntimeError, match="no model in this process"):
        c.set_sample_prompt(ASK)


def test_dashboard_panel_and_static_html_show_the_answers_newest_first(chat_session):
    from megatrain_nb.notebook.summary_html import summary_html

    s = chat_session(total_steps=20, step_time=0.005)
    _stepping(s)
    d = s.dashboard()
    assert d.samples.value == ""   # no sample prompt: no panel
    s.set_sample_prompt(ASK, every=10, max_new_tokens=2)
    s.train()
    s.wait(timeout=30)
    assert wait_until(lambda: any(a["step"] == 20 for a in s.sample_watch.answers()))
    d.refresh(force=True)
    html = d.samples.value
    assert "Answers to the sample prompt" in html and "prompt: <code>ab</code>" in html
    shown = [int(x) for x in __import__("re").findall(r"step (\d+)</td>", html)]
    assert shown == sorted(shown, reverse=True) and shown[0] == 20 and 0 in shown
    assert _expected("uabA", 20, 2) in html
    assert "Answers to the sample prompt" in summary_html(s, s.run_log.view(), final=True)


def test_report_carries_the_answers(chat_session, tmp_path):
    import nbformat

    s = chat_session(total_steps=10, step_time=0.002)
    _stepping(s)
    s.set_sample_prompt(ASK, every=5, max_new_tokens=2)
    s.train()
    s.wait(timeout=30)
    assert wait_until(lambda: any(a["step"] == 10 for a in s.sample_watch.answers()))
    nb = nbformat.read(s.export_report(tmp_path / "r.ipynb"), as_version=4)
    nbformat.validate(nb)
    text = "".join(str(c.get("outputs", "")) + c.source for c in nb.cells)
    assert "Answers to the sample prompt" in text and _expected("uabA", 10, 2) in text


def test_a_stopped_run_stops_the_watch(chat_session):
    s = chat_session(total_steps=10_000, step_time=0.002)
    _stepping(s)
    s.set_sample_prompt(ASK, every=5, max_new_tokens=2)
    s.train()
    assert wait_until(lambda: s.step >= 10)
    s.stop()
    s.wait(timeout=30)
    t = s.sample_watch._thread
    assert wait_until(lambda: not t.is_alive(), timeout=5)


def test_the_run_ends_with_the_last_answer_drawn_and_the_cap_explained(chat_session):
    """Issue 36: a saved snapshot said "drawing the answer at step 40…", with two answers for
    every=4 and no word why."""
    from megatrain_nb.notebook.summary_html import summary_html

    s = chat_session(total_steps=40, step_time=0.002)
    _stepping(s, delay=0.03)
    s.set_sample_prompt(ASK, every=4, max_new_tokens=3)
    s.train()
    assert s.wait(timeout=60) == "finished"
    w = s.sample_watch
    assert w.drawing is None and w.answers()[-1]["step"] == 40   # at once: the end waited for it
    final = summary_html(s, s.run_log.view(), final=True)
    assert "drawing the answer" not in final and "step 40</td>" in final
    assert w.skipped > 0 and len(w.answers()) < 11
    assert f"{w.skipped} answers skipped" in final and "at most 10% of the run's time" in final


@pytest.mark.parametrize("keyword,row", [("every", "sample_every"), ("max_new_tokens", "max_new_tokens"),
                                         ("temperature", "temperature"), ("seed", "sample_seed")])
def test_the_sample_prompts_values_go_through_the_table(chat_session, keyword, row):
    """Issue 44: NaN, text, 2.5 (truncated to 2) and temperature=-1 (accepted, then failing on the
    watch thread) are refused when set, with the table's words."""
    from megatrain_nb.values import ValueRefused, rule

    from tests.test_values import bad_values

    c = chat_session(total_steps=3)
    door = c.sample_watch.set_prompt if keyword == "seed" else c.set_sample_prompt   # (the Session's has no seed)
    try:
        for label, value in bad_values(row) + [("fraction", 2.5)] * (row != "temperature"):
            with pytest.raises(ValueRefused) as e:
                door(ASK, **{keyword: value})
            assert f"set_sample_prompt: {keyword}=" in str(e.value) and rule(row) in str(e.value)
        assert c.sample_watch.prompt is None
        door(ASK, **{keyword: {"every": "2", "max_new_tokens": "3", "temperature": "0.5",
                                              "seed": "7"}[keyword]})   # numbers as text count, as at every door
        assert c.sample_watch.prompt is not None
    finally:
        c.close()
