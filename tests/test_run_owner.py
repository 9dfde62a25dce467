"""One run, one owner (issue 43), read with ast:

- nothing outside ``trainer/`` assigns an attribute on a trainer (a name or attribute called
  ``trainer``, ``tr`` or ``_trainer``): drivers use the trainer's public methods
  (``use_hooks``, ``start_branch``, ``set_lr``, ...);
- no training kind overrides the step loop's private methods: a Trainer subclass defines none of
  the Run's steps, and every registered kind has the four public hooks.
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "megatrain_nb"
TRAINER_NAMES = {"trainer", "tr", "_trainer"}
LOOP_METHODS = {"_train_window", "_window_loss", "_run_step", "_begin_run", "_after_step", "_save_if_due"}


def _names_trainer(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id in TRAINER_NAMES
    return isinstance(node, ast.Attribute) and node.attr in TRAINER_NAMES


def trainer_assignments(package: Path = PACKAGE) -> list[str]:
    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package)
        if rel.parts[0] == "trainer":
            continue
        for n in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target] if isinstance(
                n, (ast.AugAssign, ast.AnnAssign)) else []
            for t in targets:
                for x in (t.elts if isinstance(t, ast.Tuple) else [t]):
                    if isinstance(x, ast.Attribute) and _names_trainer(x.value):
                        found.append(f"{rel}:{n.lineno}: sets {ast.unparse(x)}")
    return found


def test_nothing_outside_trainer_sets_attributes_on_a_trainer():
    assert trainer_assignments() == []


def test_the_checker_catches_one(tmp_path):
    pkg = tmp_path / "megatrain_nb"
    (pkg / "notebook").mkdir(parents=True)
    (pkg / "trainer").mkdir()
    (pkg / "notebook" / "a.py").write_text("def f(self, trainer):\n    trainer.x = 1\n    self.trainer.y, z = 2, 3\n")
    (pkg / "trainer" / "b.py").write_text("def g(trainer):\n    trainer.x = 1\n")
    assert trainer_assignments(pkg) == ["notebook/a.py:2: sets trainer.x", "notebook/a.py:3: sets self.trainer.y"]


def test_no_trainer_overrides_the_loop_and_every_kind_has_the_hooks():
    import megatrain_nb as mt
    from megatrain_nb.trainer import dpo, sft  # noqa: F401 - they register their kinds
    from megatrain_nb.trainer.kinds import TrainingKind, kind, kind_names

    for cls in (mt.Trainer, mt.SFTTrainer, mt.DPOTrainer, *(getattr(mt, n) for n in ("GRPOTrainer",) if hasattr(mt, n))):
        own = {k for c in cls.__mro__ if c.__module__.startswith("megatrain_nb") for k in vars(c)}
        assert not own & LOOP_METHODS, (cls.__name__, own & LOOP_METHODS)
    assert {"plain", "sft", "dpo"} <= set(kind_names())
    for name in ("plain", "sft", "dpo"):
        assert isinstance(kind(name), TrainingKind)
    with pytest.raises(ValueError, match="unknown training kind 'nope'; registered: .*dpo"):
        kind("nope")


def generated_class_attributes(package: Path = PACKAGE) -> list[str]:
    """``setattr(SomeClass, ...)`` outside a function: attributes made in a loop, which
    go-to-definition cannot find."""
    found = []
    for path in sorted(package.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        classes = {n.name for n in ast.walk(tree) if isinstance(n, ast.ClassDef)}
        for top in tree.body:
            if isinstance(top, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            for n in ast.walk(top):
                if (isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == "setattr" and n.args
                        and isinstance(n.args[0], ast.Name) and n.args[0].id in classes):
                    found.append(f"{path.relative_to(package)}:{n.lineno}: setattr({n.args[0].id}, ...)")
    return found


def test_no_class_attributes_made_in_a_loop():
    assert generated_class_attributes() == []


def test_the_engine_holds_every_part_by_name():
    import dataclasses

    from megatrain_nb.engine.parts import EngineParts, HoldsParts

    fields = [f.name for f in dataclasses.fields(EngineParts)]
    assert set(fields) <= set(HoldsParts.__annotations__)
    parts = EngineParts(**{f: object() for f in fields})
    held = HoldsParts()
    held.hold(parts)
    assert all(getattr(held, f) is getattr(parts, f) for f in fields) and held.parts is parts
