"""mt.SFTTrainer: formats, bad input (each a clear error or a counted, reported decision),
refused SFTConfig fields, evaluation metrics."""
import math
import sys

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402

import megatrain_nb as mt  # noqa: E402
from megatrain_nb.assets import as_format  # noqa: E402
from megatrain_nb.trainer.data import DataError  # noqa: E402
from megatrain_nb.trainer.sft import SFTArgumentError  # noqa: E402

from .sft_helpers import CONVS, sft_config, tiny_llama, tokenizer  # noqa: E402


def _trainer(tmp_path, rows, tok=None, **kw):
    tok = tok or tokenizer()
    cfg = {k: kw.pop(k) for k in list(kw) if k not in ("eval_dataset", "formatting_func")}
    return mt.SFTTrainer(model=tiny_llama(len(tok)), args=sft_config(tmp_path, max_steps=2, **cfg),
                         train_dataset=rows, processing_class=tok, device="cpu", **kw)


def _msgs(n=8):
    return [as_format(c, "messages") for c in CONVS[:n]]


def test_sharegpt_and_alpaca_prepare_like_their_trl_forms(tmp_path):
    tok = tokenizer()
    a = _trainer(tmp_path / "a", [as_format(c, "sharegpt") for c in CONVS[:8]], tok, assistant_only_loss=True)
    b = _trainer(tmp_path / "b", _msgs(), tok, assistant_only_loss=True)
    assert a.train_dataset["input_ids"] == b.train_dataset["input_ids"]
    assert a.train_dataset["labels"] == b.train_dataset["labels"]
    c = _trainer(tmp_path / "c", [as_format(c, "alpaca") for c in CONVS[:8]], tok)
    assert c.completion_only_loss   # alpaca -> prompt/completion: the response alone is trained on
    for ids, lab in zip(c.train_dataset["input_ids"], c.train_dataset["labels"]):
        answer = tok.decode([t for t in lab if t != -100])
        assert answer.endswith("<|end|>") and "<|user|>" not in answer
    for t in (a, b, c):
        t.close()


def test_no_chat_template_says_how_to_give_one(tmp_path):
    tok = tokenizer()
    tok.chat_template = None
    with pytest.raises(DataError, match="no chat template.*chat_template_path"):
        _trainer(tmp_path, _msgs(), tok)


def test_chat_template_path_is_read(tmp_path):
    from megatrain_nb.assets import CHAT_TEMPLATE

    tok = tokenizer()
    tok.chat_template = None
    path = tmp_path / "t.jinja"
    path.write_text(CHAT_TEMPLATE)
    t = _trainer(tmp_path / "o", _msgs(), tok, chat_template_path=str(path), assistant_only_loss=True)
    assert len(t.train_dataset) == 8
    t.close()


def test_assistant_only_loss_needs_generation_marks(tmp_path):
    from megatrain_nb.assets import CHAT_TEMPLATE

    tok = tokenizer(chat_template=CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", ""))
    with pytest.raises(DataError, match="generation"):
        _trainer(tmp_path, _msgs(), tok, assistant_only_loss=True)


def test_mixed_formats_are_refused_with_the_row(tmp_path):
    rows = _msgs(4) + [as_format(CONVS[5], "alpaca")]
    with pytest.raises(DataError, match="mixes formats.*alpaca \\(first at row 4\\)"):
        _trainer(tmp_path, rows)


def test_empty_assistant_turn_is_refused(tmp_path):
    rows = _msgs(4)
    rows[2] = {"messages": [{"role": "user", "content": "What is one plus one ?"},
                            {"role": "assistant", "content": ""}]}
    with pytest.raises(DataError, match=r"train_dataset\[2\] has an empty assistant turn"):
        _trainer(tmp_path, rows)


def test_role_the_template_cannot_render_is_refused(tmp_path):
    rows = _msgs(4)
    rows[1] = {"messages": [{"role": "tool", "content": "weather"}] + rows[1]["messages"]}
    with pytest.raises(DataError, match=r"train_dataset\[1\].*cannot render.*tool"):
        _trainer(tmp_path, rows)
    # a template that silently skips a role is caught too
    from megatrain_nb.assets import CHAT_TEMPLATE

    quiet = CHAT_TEMPLATE.replace("{% else %}{{ raise_exception('the chat template knows the roles system, user and "
                                  "assistant, not ' + message['role']) }}", "{% else %}")
    assert quiet != CHAT_TEMPLATE
    with pytest.raises(DataError, match=r"train_dataset\[1\].*left out a 'tool' message"):
        _trainer(tmp_path, rows, tokenizer(chat_template=quiet))


def test_long_examples_are_truncated_counted_and_reported_once(tmp_path):
    rows = _msgs(8)
    with pytest.warns(UserWarning, match="examples were longer than max_length") as rec:
        t = _trainer(tmp_path, rows, max_length=20)
    assert sum("longer than max_length" in str(w.message) for w in rec) == 1
    rep = t.prep_reports[0]
    lengths = [len(tokenizer().apply_chat_template(r["messages"], tokenize=True, return_dict=True)["input_ids"])
               for r in rows]
    assert rep.truncated == sum(n > 20 for n in lengths) > 0
    assert rep.tokens_dropped == sum(max(n - 20, 0) for n in lengths)
    assert all(len(x) <= 20 for x in t.train_dataset["input_ids"])
    t.close()


def test_completion_empty_after_truncation_is_dropped_and_counted(tmp_path):
    long_prompt = "What is " + " plus ".join(["one"] * 30) + " ?"
    rows = [as_format(c, "prompt_completion") for c in CONVS[:6]]
    rows[3] = {"prompt": [{"role": "user", "content": long_prompt}],
               "completion": [{"role": "assistant", "content": "many ."}]}
    with pytest.warns(UserWarning, match="1 examples had no token left to learn from"):
        t = _trainer(tmp_path, rows, max_length=40)
    assert t.prep_reports[0].no_target_dropped == 1 and len(t.train_dataset) == 5
    t.close()
    with pytest.raises(DataError, match="no example is left"):
        _trainer(tmp_path, [rows[3]], max_length=40)


@pytest.mark.parametrize("field,value", [("router_aux_loss_coef", 0.5), ("trust_remote_code", True),
                                         ("chat_template_path", "org/other-model"), ("loss_type", "chunked")])
def test_sft_fields_that_cannot_apply_are_refused_by_name(tmp_path, field, value):
    with pytest.raises((SFTArgumentError, ValueError), match=field):
        _trainer(tmp_path, _msgs(), **{field: value})


def test_missing_trl_names_the_extra(monkeypatch):
    from megatrain_nb.trainer.sft_data import require_trl

    monkeypatch.setitem(sys.modules, "trl", None)
    with pytest.raises(ImportError, match=r'pip install "megatrain-nb\[sft\]"'):
        require_trl()


def test_engine_does_not_import_trl():
    import subprocess

    code = ("import sys, megatrain_nb.engine, megatrain_nb.trainer; import megatrain_nb as mt; mt.Trainer; "
            "assert 'trl' not in sys.modules, 'trl imported'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_evaluate_logs_token_accuracy_and_entropy(tmp_path):
    tok = tokenizer()
    rows = _msgs(6)
    t = _trainer(tmp_path, rows, tok, assistant_only_loss=True, eval_dataset=rows[:4], per_device_eval_batch_size=2)
    metrics = t.evaluate()
    # the same numbers from the Hugging Face model itself on the prepared eval rows
    model = tiny_llama(len(tok))
    correct = n = 0
    ent = 0.0
    with torch.no_grad():
        for ids, lab in zip(t.eval_dataset["input_ids"], t.eval_dataset["labels"]):
            logits = model(input_ids=torch.tensor([ids]), use_cache=False).logits[0, :-1]
            target = torch.tensor(lab[1:])
            keep = target != -100
            logp = torch.log_softmax(logits[keep], -1)
            correct += int((logits[keep].argmax(-1) == target[keep]).sum())
            ent += float(-(logp.exp() * logp).sum())
            n += int(keep.sum())
    assert metrics["eval_mean_token_accuracy"] == pytest.approx(correct / n, abs=1e-6)
    assert metrics["eval_entropy"] == pytest.approx(ent / n, rel=1e-4)
    assert 0 < metrics["eval_entropy"] <= math.log(len(tok)) + 1e-4
    assert "eval_mean_token_accuracy" in t.state.log_history[-1]
    t.close()


def test_train_logs_token_metrics(tmp_path):
    t = _trainer(tmp_path, _msgs(8), assistant_only_loss=True)
    t.train()
    logged = [h for h in t.state.log_history if "loss" in h]
    assert logged and all("mean_token_accuracy" in h and "entropy" in h for h in logged)
    t.close()


def test_text_and_formatting_func_train_on_every_token(tmp_path):
    tok = tokenizer()
    rows = [as_format(c, "alpaca") for c in CONVS[:6]]
    t = mt.SFTTrainer(model=tiny_llama(len(tok)), args=sft_config(tmp_path, max_steps=1), train_dataset=rows,
                      processing_class=tok, device="cpu",
                      formatting_func=lambda ex: f"{ex['instruction']} {ex['output']}")
    for ids, lab in zip(t.train_dataset["input_ids"], t.train_dataset["labels"]):
        assert ids == lab and ids[-1] == tok.eos_token_id   # language modelling: EOS added, every token
    t.train()
    t.close()


def test_skip_prepare_dataset_with_masks_but_no_labels_is_refused(tmp_path):
    rows = [{"input_ids": [4, 5, 6, 7], "assistant_masks": [0, 0, 1, 1]}] * 4
    with pytest.raises(DataError, match="mask columns but no 'labels'"):
        _trainer(tmp_path, rows, dataset_kwargs={"skip_prepare_dataset": True})
    t = _trainer(tmp_path, [{"input_ids": [4, 5, 6, 7], "labels": [-100, -100, 6, 7]}] * 4,
                 dataset_kwargs={"skip_prepare_dataset": True})
    assert t.train_dataset[0]["labels"] == [-100, -100, 6, 7]   # used as given
    t.train()
    t.close()


def test_resume_continues_exactly(tmp_path):
    """A packed run saved at step 2 and resumed ends with the weights of an uninterrupted run."""
    tok = tokenizer()
    rows = _msgs(24)
    kw = dict(packing=True, max_length=64, assistant_only_loss=True, gradient_accumulation_steps=2, max_steps=4,
              per_device_train_batch_size=2)

    def make(out, **extra):
        return mt.SFTTrainer(model=tiny_llama(len(tok)), args=sft_config(out, **kw, **extra), train_dataset=rows,
                             processing_class=tok, device="cpu")

    full = make(tmp_path / "full")
    full.train()
    want = {n: p.clone() for n, p in full.engine.named_parameters()}
    full.close()
    first = make(tmp_path / "cut", save_strategy="steps", save_steps=2)
    gen = first.iter_steps()
    next(gen), next(gen)
    gen.close()
    first.close()
    second = make(tmp_path / "cut")
    second.train(resume_from_checkpoint=str(tmp_path / "cut" / "checkpoint-2"))
    for n, p in second.engine.named_parameters():
        assert torch.equal(p, want[n]), n
    second.close()


def _chat(answer):
    return {"messages": [{"role": "user", "content": "what is the weather"}, {"role": "assistant", "content": answer}]}


@pytest.mark.parametrize("bad,said", [
    ({"messages": [{"role": "user", "content": 5}]}, r"\[3\] \(messages\): 'messages'\[0\] has content=5 \(an int\)"),
    ({"messages": [{"role": "user", "content": ["a"]}]}, r"\[3\] \(messages\): 'messages'\[0\] has content=\['a'\]"),
    ({"messages": [{"role": "user", "content": {"a": 1}}]}, r"\[3\] \(messages\).*content=\{'a': 1\} \(a dict\)"),
    ({"messages": "hello"}, r"\[3\] \(messages\): 'messages' is a str, not a list"),
])
def test_malformed_conversation_rows_are_named_by_index(tmp_path, bad, said):
    """Issue 33 item 5: ArrowInvalid / ArrowTypeError naming no row."""
    rows = [_chat("sunny"), _chat("rain"), _chat("snow"), bad]
    with pytest.raises(DataError, match=r"train_dataset" + said):
        _trainer(tmp_path, rows)


@pytest.mark.parametrize("rows,said", [
    ([{"instruction": "a", "output": "b"}, {"instruction": "a", "output": 3}],
     r"train_dataset\[1\] \(alpaca\): 'output' is an int \(3\), not text"),
    ([{"prompt": "a", "completion": "b"}, {"prompt": "a", "completion": 3}],
     r"train_dataset\[1\] \(prompt_completion\): 'prompt' and 'completion' must both be text"),
    ([{"text": "the weather"}, {"text": 3}], r"train_dataset\[1\] \(text\): 'text' is an int"),
    ([{"text": "the weather"}, {"text": ""}], r"train_dataset\[1\] \(text\): 'text' is empty"),
])
def test_malformed_plain_rows_are_named_by_index(tmp_path, rows, said):
    with pytest.raises(DataError, match=said):
        _trainer(tmp_path, rows)


def test_an_empty_text_row_of_a_dataset_is_named_at_once(tmp_path):
    """It failed at the first step: "a batch has sequences of 1 token", naming no row."""
    rows = Dataset.from_list([{"text": "the weather is sunny"}] * 3 + [{"text": ""}])
    with pytest.raises(DataError, match=r"train_dataset\[3\] \(text\): 'text' is empty"):
        _trainer(tmp_path, rows)


def test_packing_drops_a_document_cut_to_its_prompt_with_assistant_only_loss(tmp_path):
    """bfd packing truncates a long document; one left with only its prompt holds no target: dropped,
    counted and said (it failed late), and with no document left the error says so at once."""
    from megatrain_nb.assets import chat_tokenizer

    long_prompt = {"messages": [{"role": "user", "content": "what is the weather " * 20},
                                {"role": "assistant", "content": "rain"}]}
    kw = dict(tok=chat_tokenizer(), assistant_only_loss=True, packing=True, max_length=24)
    t = _trainer(tmp_path, [_chat("sunny"), long_prompt, _chat("snow")], **kw)
    assert t.prep_reports[0].no_target_dropped == 1
    t.train()
    t.close()
    with pytest.raises(DataError, match="no example is left with a token to learn from"):
        _trainer(tmp_path, [long_prompt], **kw)


def test_a_conversation_with_no_assistant_turn_is_counted_dropped_and_said(tmp_path):
    """Issue 33 item 5: kept and trained on without a word; with assistant_only_loss it holds no target."""
    from megatrain_nb.assets import chat_tokenizer

    rows = [_chat("sunny"), {"messages": [{"role": "user", "content": "what is the weather"}]}, _chat("rain")]
    with pytest.warns(UserWarning, match="1 conversations had no assistant turn"):
        t = _trainer(tmp_path, rows, tok=chat_tokenizer(), assistant_only_loss=True)
    assert t.prep_reports[0].no_assistant_dropped == 1 and len(t.train_dataset) == 2
    t.close()
