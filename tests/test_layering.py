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
import functools
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megatrain_nb"

# Internals of other libraries that the engine reaches on purpose, each for a stated reason:
FOREIGN = {
    "_parameters", "_buffers", "_modules",   # torch.nn.Module: rebinding weights to device slots
    "_forward_hooks", "_forward_pre_hooks",   # torch.nn.Module: a hooked module is not run in tiles (tiling.py)
    "_backward_hooks",                        # torch.Tensor: a hooked (frozen) weight's tiles are not added straight in
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


# ---------------------------------------------------------------------------------- import directions
"""Layers, lowest first: a module imports only from its own layer or the layers below it.

shared utilities -> the run-control channel (heartbeats and inboxes: megatrain_nb/channel/) ->
engine -> trainer -> the launcher (torchrun) -> the fronts (notebook, CLI, the Jupyter server's
handlers in megatrain_nb/lab/). The fronts do not import each other.
"""
LAYERS = {
    "shared": ("values", "formatting", "atomic", "threads", "processes", "commands", "env_vars", "hub",
               "loopback", "manifest", "model_configs", "tiny_configs", "model_source", "gguf_in", "learning_rate",
               "assets", "rewards"),
    # the files a kernel or a rank and the Jupyter server talk through (heartbeats, inboxes)
    "channel": ("channel",),
    "engine": ("engine",),
    "trainer": ("trainer", "estimate_words", "sweep", "export"),
    "launcher": ("torchrun", "torchrun_boot"),
    "front": ("notebook", "cli", "lab"),
}
ORDER = list(LAYERS)
#: imports against the direction, each with its reason (to be removed, not added to)
UPWARD_ALLOWED: dict = {}
#: circles (nested imports counted), each with its reason (to be removed, not added to)
CYCLES_ALLOWED = {
    frozenset({"megatrain_nb.engine.updates.codecs", "megatrain_nb.engine.updates.fused_update"}):
        "the codecs encode through the fused kernels, and the kernels take the codecs' levels and check "
        "themselves against the codecs' torch path when they are built",
}


def _module_name(path: Path, package: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _place(module: str) -> tuple[str, str]:
    """(layer, unit) of a package module: the unit is the entry of LAYERS it falls under."""
    rest = module.split(".", 1)[1] if "." in module else ""
    best = None
    for layer, units in LAYERS.items():
        for unit in units:
            if (rest == unit or rest.startswith(unit + ".")) and (best is None or len(unit) > len(best[1])):
                best = (layer, unit)
    if best is None:
        raise AssertionError(f"{module} is in no layer: add it to LAYERS in tests/test_layering.py")
    return best


def import_edges(package: Path = None) -> list[tuple[str, str, tuple, bool, int]]:
    """(module, imported package module, names, inside a function, line) for every import of
    the package's own modules, read by ast."""
    return _edges(package or PACKAGE)


@functools.lru_cache(maxsize=4)
def _edges(package: Path) -> list[tuple[str, str, tuple, bool, int]]:
    files = {_module_name(p, package): p for p in package.rglob("*.py")}
    out = []
    for module, path in sorted(files.items()):
        tree = ast.parse(path.read_text(), filename=str(path))
        nested = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
                  for n in ast.walk(f)}
        typing_only = {id(n) for f in ast.walk(tree) if isinstance(f, ast.If) and "TYPE_CHECKING" in ast.unparse(f.test)
                       for n in ast.walk(f)}   # annotations only: never imported at run time
        for n in ast.walk(tree):
            if id(n) in typing_only:
                continue
            if isinstance(n, ast.Import):
                targets = [(a.name, ()) for a in n.names]
            elif isinstance(n, ast.Call) and _dynamic_import(n) is not None:
                # importlib.import_module("megatrain_nb.x") / __import__(...): an import all the same
                name = _dynamic_import(n)
                level = len(name) - len(name.lstrip("."))
                if level:
                    up = module.split(".")[: len(module.split(".")) - level + (path.name == "__init__.py")]
                    name = ".".join(up + ([name.lstrip(".")] if name.lstrip(".") else []))
                targets = [(name, ())]
            elif isinstance(n, ast.ImportFrom):
                base = n.module or ""
                if n.level:
                    up = module.split(".")[: len(module.split(".")) - n.level + (path.name == "__init__.py")]
                    base = ".".join(up + ([n.module] if n.module else []))
                subs = [f"{base}.{a.name}" for a in n.names if f"{base}.{a.name}" in files]
                names = tuple(a.name for a in n.names)
                targets = [(s, ()) for s in subs] if len(subs) == len(n.names) else [(base, names)]
            else:
                continue
            out += [(module, t, names, id(n) in nested, n.lineno) for t, names in targets
                    if t == PACKAGE.name or t.startswith(PACKAGE.name + ".")]
    return out


def _dynamic_import(call: ast.Call):
    """The module a call of ``importlib.import_module``/``import_module``/``__import__`` names by a
    string literal (relative names too: ``import_module(".x", __name__)``); None for any other call.
    (A package ``__init__``'s PEP 562 ``__getattr__`` names its modules in a table: not counted.)"""
    f = call.func
    name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
    if name not in ("import_module", "__import__") or not call.args:
        return None
    arg = call.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        return str(arg.values[0].value).rstrip(".") or None   # f"megatrain_nb.x.{y}": its fixed prefix
    return None


def direction_violations(edges) -> list[str]:
    found = []
    for module, target, names, _, line in edges:
        if target == PACKAGE.name:   # the package's facade: only its version may be imported from below
            if set(names) - {"__version__"}:
                found.append(f"{module}:{line}: imports {names} from the package facade")
            continue
        if module == PACKAGE.name or (module, target) in UPWARD_ALLOWED:
            continue
        (layer, unit), (t_layer, t_unit) = _place(module), _place(target)
        if ORDER.index(t_layer) > ORDER.index(layer):
            found.append(f"{module}:{line}: {layer} imports {target} ({t_layer}, above it)")
        elif layer == t_layer == "front" and unit != t_unit:
            found.append(f"{module}:{line}: {unit} imports {target} (another front)")
    return found


def import_cycles(edges, with_nested: bool = True) -> list[list[str]]:
    """Cycles of the import graph, imports inside functions counted (issue 43: a nested import
    must not hide a circle); ``with_nested=False``: the module-level graph alone."""
    graph: dict[str, set[str]] = {}
    for module, target, _, nested, _ in edges:
        if (with_nested or not nested) and target != module:
            graph.setdefault(module, set()).add(target)
    cycles, state = [], {}

    def visit(node, stack):
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                cycles.append(stack[stack.index(nxt):] + [nxt])
            elif nxt not in state:
                visit(nxt, stack)
        stack.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [])
    return cycles


#: imports of the package's own modules inside functions: 241 before issue 34, 169 after its layer
#: work, 188 with the step-time prediction, long rows and the disk-held gradients merged beside it (their CLI, estimator
#: and header lines keep `megatrain-nb --help` and `mt.estimate` free of torch), 166 once the engine's
#: package loads lazily and the planning modules import no torch (issue 43: the estimator imports
#: them at its top) and five two-file circles were cut, 143 after the imports that bring nothing
#: heavier than their module already imports went to its top, 54 once the trainer's and the notebook's
#: packages load their names lazily (PEP 562), the CLI's commands that train import the Trainer at
#: their tops behind one import per command, and the modules reached only from torch-importing code
#: import at their tops, 41 once a Session's own imports and the planner's family names went up
#: too, 42 with the GRPO panel's chart kept from %load_ext, 41 once the DPO and GRPO panels share
#: one chart panel (issue 43 item 3; imports by name, importlib.import_module("megatrain_nb..."), are
#: counted too). A ratchet: lower it when one goes; each one left says on its line or the line
#: above why — which heavy module it keeps from which light entry point (LIGHT_ENTRY_POINTS), or
#: which circle it breaks.
MAX_NESTED_OWN_IMPORTS = 41


def test_imports_point_down_the_layers():
    assert direction_violations(import_edges()) == []


def test_no_import_cycles():
    found = [c for c in import_cycles(import_edges()) if frozenset(c) not in CYCLES_ALLOWED]
    assert found == []


def test_nested_imports_of_own_modules_do_not_grow():
    nested = {(m, line) for m, _, _, inside, line in import_edges() if inside}
    assert len(nested) <= MAX_NESTED_OWN_IMPORTS, len(nested)


def test_the_direction_checker_catches_an_upward_import_and_a_cycle(tmp_path, monkeypatch):
    pkg = tmp_path / "megatrain_nb"
    (pkg / "engine").mkdir(parents=True)
    (pkg / "notebook").mkdir()
    for f in ("__init__.py", "engine/__init__.py", "notebook/__init__.py", "values.py"):
        (pkg / f).write_text("")
    (pkg / "engine" / "a.py").write_text("def f():\n    from megatrain_nb.notebook import b\n")
    (pkg / "notebook" / "b.py").write_text("from . import c\n")
    (pkg / "notebook" / "c.py").write_text("from megatrain_nb.notebook.b import x\n")
    monkeypatch.setitem(globals(), "PACKAGE", pkg)
    edges = import_edges(pkg)
    assert any("engine imports megatrain_nb.notebook.b (front, above it)" in v for v in direction_violations(edges))
    assert import_cycles(edges) == [["megatrain_nb.notebook.b", "megatrain_nb.notebook.c", "megatrain_nb.notebook.b"]]


def _unexplained(edges) -> list[str]:
    """Function-level imports of own modules without a comment on their line or the line above."""
    found, lines = [], {}
    for module, _, _, inside, line in sorted(set((m, "", (), i, ln) for m, _, _, i, ln in edges)):
        if not inside:
            continue
        parts = module.split(".")[1:]
        path = PACKAGE.joinpath(*parts) if parts else PACKAGE
        path = path / "__init__.py" if path.is_dir() else path.with_suffix(".py")
        text = lines.setdefault(path, path.read_text().splitlines())
        if "#" not in text[line - 1] and not text[line - 2].strip().startswith("#"):
            found.append(f"{module}:{line}: {text[line - 1].strip()}")
    return found


def test_each_nested_import_says_why():
    """Each function-level import of an own module says why on its line or the line above:
    which heavy module it keeps from which light entry point, or which circle it breaks."""
    assert _unexplained(import_edges()) == []


def test_the_nested_count_sees_imports_by_name(tmp_path, monkeypatch):
    """importlib.import_module("megatrain_nb...") in a function is a function-level import too."""
    pkg = tmp_path / "megatrain_nb"
    (pkg / "engine").mkdir(parents=True)
    for f in ("__init__.py", "engine/__init__.py", "engine/b.py", "values.py"):
        (pkg / f).write_text("")
    (pkg / "engine" / "a.py").write_text(
        "import importlib\n\ndef f():\n    return importlib.import_module('megatrain_nb.engine.b')\n\n"
        "def g():\n    return importlib.import_module('.b', __package__)\n\n"
        "def h():\n    return __import__('megatrain_nb.values')\n")
    monkeypatch.setitem(globals(), "PACKAGE", pkg)
    nested = sorted((m, t, line) for m, t, _, inside, line in import_edges(pkg) if inside)
    assert nested == [("megatrain_nb.engine.a", "megatrain_nb.engine.b", 4),
                      ("megatrain_nb.engine.a", "megatrain_nb.engine.b", 7),
                      ("megatrain_nb.engine.a", "megatrain_nb.values", 10)]
    assert len(_unexplained(import_edges(pkg))) == 3   # none says why


#: What the light entry points may not import: `import megatrain_nb`, `megatrain-nb --help`,
#: `mt.estimate`, `%load_ext megatrain_nb` (the magics) and the Jupyter server extension's package.
LIGHT_ENTRY_POINTS = """
import sys
import megatrain_nb as mt
from megatrain_nb.cli import main
try:
    main(["--help"])
except SystemExit:
    pass
mt.estimate, mt.load_ipython_extension
import megatrain_nb.lab
print("HEAVY", sorted(m for m in ("torch", "transformers", "trl", "datasets", "ipywidgets") if m in sys.modules))
"""


def test_the_light_entry_points_import_no_torch_nor_widgets():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", LIGHT_ENTRY_POINTS], capture_output=True, text=True, timeout=120)
    assert "HEAVY []" in out.stdout, out.stdout[-300:] + out.stderr[-2000:]


# ---------------------------------------------------------------------------------- environment variables
def _env_names_in_code() -> dict[str, list[str]]:
    import re

    pattern = re.compile(r"^(MEGATRAIN|MTNB)[A-Z0-9_]*$")
    found: dict[str, list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if path.name == "env_vars.py" and path.parent == PACKAGE:
            continue
        for n in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and pattern.match(n.value):
                found.setdefault(n.value, []).append(f"{path.relative_to(PACKAGE)}:{n.lineno}")
    return found


def test_every_environment_variable_is_in_the_table():
    from megatrain_nb.env_vars import ENV_VARS

    in_code = _env_names_in_code()
    assert sorted(set(in_code) - set(ENV_VARS)) == [], "add them to megatrain_nb/env_vars.py"
    assert sorted(set(ENV_VARS) - set(in_code)) == [], "no code reads them: remove the rows"
    for name, var in ENV_VARS.items():
        assert var.meaning and var.default, name
        assert any(where.startswith(var.reader + ":") for where in in_code[name]), (name, in_code[name])
