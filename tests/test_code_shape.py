"""The shape of the code (issue 34, "Done when"), read with ast:

- no function over 80 lines and no class over 40 methods in megatrain_nb/;
- engine/engine.py under 500 lines;
- the update scheduler (engine/updates/updates.py) is its step protocol: every method that only forwards
  to one of its parts has a caller outside the scheduler;
- parts are built after what they need: no constructor hands out a closure over an attribute
  of ``self`` that it assigns only later (a late-bound callback hiding a mutual dependency).
"""
from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megatrain_nb"
MAX_FUNCTION_LINES = 80
MAX_CLASS_METHODS = 40
MAX_ENGINE_LINES = 500


def _trees(package: Path):
    for path in sorted(package.rglob("*.py")):
        yield path.relative_to(package.parent), ast.parse(path.read_text(), filename=str(path))


def long_functions(package: Path = PACKAGE) -> list[str]:
    return [f"{where}:{n.lineno} {n.name}: {n.end_lineno - n.lineno + 1} lines"
            for where, tree in _trees(package) for n in ast.walk(tree)
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno - n.lineno + 1 > MAX_FUNCTION_LINES]


def big_classes(package: Path = PACKAGE) -> list[str]:
    found = []
    for where, tree in _trees(package):
        for n in ast.walk(tree):
            if isinstance(n, ast.ClassDef):
                count = sum(isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in n.body)
                if count > MAX_CLASS_METHODS:
                    found.append(f"{where}:{n.lineno} {n.name}: {count} methods")
    return found


def _forwarded(fn: ast.FunctionDef) -> bool:
    """Whether ``fn``'s body (its docstring aside) is one call on an attribute of ``self``'s
    attribute (``self.part.method(...)``, returned or not)."""
    body = [s for s in fn.body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant))]
    if len(body) != 1 or not isinstance(body[0], (ast.Return, ast.Expr)):
        return False
    call = body[0].value
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)):
        return False
    owner = call.func.value
    while isinstance(owner, ast.Attribute):
        owner = owner.value
    return isinstance(owner, ast.Name) and owner.id == "self"


def uncalled_forwarders(package: Path = PACKAGE, module: str = "engine/updates/updates.py",
                        cls: str = "UpdateScheduler") -> list[str]:
    """Methods of ``cls`` that only forward and whose name no other file (tests aside) calls."""
    used, methods = set(), []
    for where, tree in _trees(package):
        if str(where).endswith(module):
            methods = [b for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls
                       for b in n.body if isinstance(b, ast.FunctionDef) and not b.name.startswith("__")]
            continue
        used |= {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
    return [m.name for m in methods if _forwarded(m) and m.name not in used]


def late_bound_callbacks(package: Path = PACKAGE) -> list[str]:
    """A lambda or nested function in an ``__init__`` reading ``self.x`` that the same
    ``__init__`` assigns only after it."""
    found = []
    for where, tree in _trees(package):
        for init in ast.walk(tree):
            if not (isinstance(init, ast.FunctionDef) and init.name == "__init__"):
                continue
            assigned: dict = {}
            for n in ast.walk(init):
                if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store) \
                        and isinstance(n.value, ast.Name) and n.value.id == "self":
                    assigned.setdefault(n.attr, n.lineno)
            for fn in ast.walk(init):
                if fn is init or not isinstance(fn, (ast.Lambda, ast.FunctionDef)):
                    continue
                for n in ast.walk(fn):
                    if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id == "self" \
                            and assigned.get(n.attr, 0) > fn.lineno:
                        found.append(f"{where}:{fn.lineno}: reads self.{n.attr}, assigned at line "
                                     f"{assigned[n.attr]}")
    return found


def test_no_function_over_80_lines():
    assert long_functions() == []


def test_no_class_over_40_methods():
    assert big_classes() == []


def test_the_engine_module_stays_under_500_lines():
    lines = len((PACKAGE / "engine" / "engine.py").read_text().splitlines())
    assert lines < MAX_ENGINE_LINES, lines


def test_the_update_scheduler_forwards_only_what_someone_calls():
    assert uncalled_forwarders() == []


def test_no_part_is_handed_a_callback_to_something_built_later():
    assert late_bound_callbacks() == []


def test_the_checkers_catch_each_breach(tmp_path):
    pkg = tmp_path / "megatrain_nb"
    (pkg / "engine" / "updates").mkdir(parents=True)
    long_body = "".join(f"    x{i} = {i}\n" for i in range(MAX_FUNCTION_LINES))
    methods = "".join(f"    def m{i}(self):\n        pass\n" for i in range(MAX_CLASS_METHODS + 1))
    (pkg / "a.py").write_text(f"def long():\n{long_body}\n\nclass Big:\n{methods}")
    (pkg / "engine" / "updates" / "updates.py").write_text(
        "class UpdateScheduler:\n"
        "    def __init__(self, make):\n"
        "        self.intake = make(submit=lambda u: self.runner.submit(u))\n"
        "        self.runner = make()\n\n"
        "    def used(self):\n        return self.runner.used()\n\n"
        "    def unused(self):\n        '''Forwards.'''\n        return self.runner.unused()\n\n"
        "    def works(self):\n        self.runner.a()\n        self.intake.b()\n")
    (pkg / "engine" / "caller.py").write_text("def f(s):\n    return s.used()\n")
    assert [x.split(" ")[1] for x in long_functions(pkg)] == ["long:"]
    assert [x.split(" ")[1] for x in big_classes(pkg)] == ["Big:"]
    assert uncalled_forwarders(pkg) == ["unused"]
    assert late_bound_callbacks(pkg) == ["megatrain_nb/engine/updates/updates.py:3: reads self.runner, assigned at line 4"]
