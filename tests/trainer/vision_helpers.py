"""Shared pieces of the vision trainer tests (test_sft_vision, test_dpo_vision): a TRL trainer and
a megatrain trainer trained, each recording the inputs its model's forward got."""
import torch


def recorded(kw: dict, keys) -> dict:
    """The ``keys`` of a forward's inputs, copied."""
    return {k: kw[k].detach().clone() for k in keys if kw.get(k) is not None}


def train_trl(trainer, keys):
    """Train a TRL trainer; returns (the training forwards' inputs, the log records with a loss,
    the final weights)."""
    seen = []
    h = trainer.model.register_forward_pre_hook(
        lambda m, a, kw: seen.append(recorded(kw, keys)) if m.training else None, with_kwargs=True)
    trainer.train()
    h.remove()
    logs = [r for r in trainer.state.log_history if "loss" in r]
    return seen, logs, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def train_mt(trainer, keys):
    """Train a megatrain trainer; returns (the micro-batches the engine got, the log records with a
    loss, the final weights)."""
    seen, original = [], trainer.engine.forward_backward

    def record(batch, *a, **kw):
        seen.extend(recorded(b, keys) for b in (batch if isinstance(batch, list) else [batch]))
        return original(batch, *a, **kw)

    trainer.engine.forward_backward = record
    trainer.train()
    logs = [r for r in trainer.state.log_history if "loss" in r]
    return seen, logs, {n: w.clone() for n, w in trainer.engine.named_parameters()}


def flipped(ds):
    """The same rows with each picture mirrored: other pixels, the same text."""
    return ds.map(lambda ex: {"images": [im.transpose(0) for im in ex["images"]]})


def apart_with_other_pictures(run_trl, run_mt, model, ds, proc, config, tmp_path) -> float:
    """Two steps of TRL on ``ds`` and of megatrain on its mirrored pictures: the weights' largest
    relative difference (of the update), which a comparison that can fail finds large."""
    from .sft_helpers import max_rel_diff

    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    kw = dict(max_length=None, max_steps=2)
    trl_w = run_trl(model, ds, config(tmp_path / "trl", **kw), proc)[2]
    ours = run_mt(model, flipped(ds), config(tmp_path / "mt", **kw), proc)
    ours[-1].close()
    return max_rel_diff(ours[2], trl_w, start)


def tower_names(model) -> list:
    """Qwen2-VL's vision tower without its merger (the projector)."""
    return [n for n, _ in model.named_parameters() if n.startswith("model.visual.") and ".merger." not in n]


def check_weights(ours: dict, theirs: dict, start: dict, tower: list, frozen: bool) -> None:
    """The final weights equal TRL's to round-off (of the update); the tower frozen: bit-identical
    to the start in both, else every one of its weights moved."""
    from .sft_helpers import max_rel_diff

    assert max_rel_diff(ours, theirs, start) < 1e-4
    if frozen:
        assert all(torch.equal(ours[n], start[n]) and torch.equal(theirs[n], start[n]) for n in tower)
    else:
        assert all(not torch.equal(ours[n], start[n]) for n in tower)
