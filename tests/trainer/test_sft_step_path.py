"""Preparation is never on the step's path (issue 20's benchmark target): once mt.SFTTrainer is
built from a map-style dataset, training steps neither tokenise, apply the chat template nor map
the dataset again; the steps see the prepared rows only."""
import pytest

pytest.importorskip("trl")

import megatrain_nb as mt  # noqa: E402
from megatrain_nb.assets import as_format  # noqa: E402

from .sft_helpers import CONVS, sft_config, tiny_llama, tokenizer  # noqa: E402


def test_steps_do_not_tokenise_or_map(tmp_path, monkeypatch):
    import datasets

    tok = tokenizer()
    rows = [as_format(c, "messages") for c in CONVS[:16]]
    t = mt.SFTTrainer(model=tiny_llama(len(tok)), args=sft_config(tmp_path, max_steps=3, assistant_only_loss=True),
                      train_dataset=rows, processing_class=tok, device="cpu")
    calls = []

    def forbid(name):
        def refuse(*a, **k):
            calls.append(name)
            raise AssertionError(f"{name} called during a training step")
        return refuse

    for name in ("__call__", "apply_chat_template", "encode"):
        monkeypatch.setattr(type(t.tokenizer), name, forbid(f"tokenizer.{name}"))
    monkeypatch.setattr(datasets.Dataset, "map", forbid("Dataset.map"))
    monkeypatch.setattr(datasets.Dataset, "filter", forbid("Dataset.filter"))
    records = list(t.iter_steps())
    assert [r["step"] for r in records] == [1, 2, 3] and calls == []
    t.close()
