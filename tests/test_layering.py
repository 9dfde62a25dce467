"""House rules that keep the package's seams public (issue 22, "Done when").

- No module imports another module's private name (``from x import _y``).
- No module reads another class's private attributes: ``obj._name`` is allowed only where
  ``obj`` is ``self``/``cls``, or where ``_name`` is an attribute the same file defines itself
  (a class's own helper reaching its own fields from a decorator or a nested function).
  PyTorch's and transformers' documented internals (``Module._parameters`` and friends) are
  the one exception, listed by name below.
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megatrain_nb"

# Internals of other libraries that the engine reaches on purpose, each for a stated reason:
FOREIGN = {
    "_parameters", "_buffers", "_modules",   # torch.nn.Module: rebinding weights to device slots
    "_forward_hooks", "_forward_pre_hooks",   # torch.nn.Module: a hooked module is not run in tiles (tiling.py)
    "_init_weights",                          # transformers: the model's own per-module init
    "_fused_adamw_",                          # torch: the fused CPU AdamW kernel on flat buffers
    "_repr_html_",                            # IPython's display protocol
    "_C",                                     # torch: the caching host allocator's emptyCache (no public call)
}


def _defined_here(tree: ast.AST) -> set[str]:
    """Private attribute names this file assigns on ``self``/``cls`` or defines in a class body."""
    names: set[str] = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) \
                and isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
            names.add(n.attr)
        elif isinstance(n, ast.ClassDef):
            for b in n.body:
                if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    names.add(b.name)
                elif isinstance(b, ast.AnnAssign) and isinstance(b.target, ast.Name):
                    names.add(b.target.id)
                elif isinstance(b, ast.Assign):
                    names.update(t.id for t in b.targets if isinstance(t, ast.Name))
    return {x for x in names if x.startswith("_")}


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def violations() -> list[str]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        own = _defined_here(tree)
        where = path.relative_to(PACKAGE.parent)
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom):
                found += [f"{where}:{n.lineno}: imports private {n.module}.{a.name}"
                          for a in n.names if _private(a.name)]
            elif isinstance(n, ast.Attribute) and _private(n.attr):
                if isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"):
                    continue
                if n.attr in own or n.attr in FOREIGN:
                    continue
                found.append(f"{where}:{n.lineno}: reads {ast.unparse(n)}")
    return found


def test_no_module_reaches_into_another_modules_privates():
    assert violations() == []


def test_the_checker_catches_a_reach(tmp_path, monkeypatch):
    pkg = tmp_path / "megatrain_nb"
    pkg.mkdir()
    (pkg / "a.py").write_text("from megatrain_nb.b import _hidden\n\ndef f(x):\n    return x._state\n")
    monkeypatch.setitem(globals(), "PACKAGE", pkg)
    got = violations()
    assert any("imports private megatrain_nb.b._hidden" in g for g in got)
    assert any("reads x._state" in g for g in got)
