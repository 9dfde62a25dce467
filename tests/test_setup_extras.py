"""`bash scripts/setup.sh lab` installs what the shipped notebooks import (issue 36: notebook 04
failed out of the box for want of TRL)."""
import json
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STDLIB_AND_BASE = {"megatrain_nb", "transformers", "datasets", "torch", "numpy", "os", "json", "time", "math",
                   "pathlib", "IPython", "ipywidgets"}
DIST = {"trl": "trl", "PIL": "pillow"}   # import name -> distribution name, for optional imports the notebooks use


def _notebook_imports() -> set:
    names = set()
    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for cell in json.loads(nb.read_text())["cells"]:
            if cell["cell_type"] == "code":
                src = "".join(cell["source"])
                names |= set(re.findall(r"^\s*(?:from|import)\s+([A-Za-z_]\w*)", src, flags=re.M))
    return names


def test_the_lab_extra_holds_every_optional_package_a_notebook_imports():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    lab = {re.split(r"[<>=\[ ]", r)[0].lower() for r in project["optional-dependencies"]["lab"]}
    base = {re.split(r"[<>=\[ ]", r)[0].lower() for r in project["dependencies"]}
    optional = _notebook_imports() - STDLIB_AND_BASE - set(sys.stdlib_module_names)
    assert "trl" in optional   # notebook 04
    missing = [n for n in optional if DIST.get(n, n).lower() not in lab | base]
    assert not missing, f"notebooks import {missing}, which `setup.sh lab` ([lab]) does not install"
    assert "lab" in (ROOT / "scripts" / "setup.sh").read_text()
