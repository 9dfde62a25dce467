"""The wheel: one install carries the prebuilt JupyterLab extension when it was built (Node.js
only at build time), builds without Node.js otherwise, and pyproject names nothing unpublished."""
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
LABEXT = "share/jupyter/labextensions/megatrain-nb-lab/"


def _tree(tmp_path: Path, *, built: bool) -> Path:
    """A copy of what a wheel build reads; ``built``: with a (minimal) built labextension."""
    src = tmp_path / "src"
    src.mkdir(parents=True)
    for name in ("pyproject.toml", "setup.py", "README.md", "MANIFEST.in"):
        shutil.copy(REPO / name, src / name)
    shutil.copytree(REPO / "megatrain_nb", src / "megatrain_nb", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "jupyter-config", src / "jupyter-config")
    (src / "extension").mkdir()
    shutil.copy(REPO / "extension" / "package.json", src / "extension" / "package.json")
    if built:
        out = src / "extension" / "megatrain_nb_lab" / "labextension"
        (out / "static").mkdir(parents=True)
        (out / "package.json").write_text(json.dumps({"name": "megatrain-nb-lab", "version": "0.1.0"}))
        (out / "static" / "remoteEntry.0123abcd.js").write_text("// built by jupyter-builder")
    return src


def _build(src: Path, tmp_path: Path, **flags) -> tuple[zipfile.ZipFile, str]:
    no_node = tmp_path / "bin"
    no_node.mkdir(exist_ok=True)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{no_node}:/usr/sbin:/sbin"}
    env = {k: v for k, v in env.items() if not k.startswith("MEGATRAIN_NB_")} | flags
    assert shutil.which("node", path=env["PATH"]) is None
    p = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation", "-w",
                        str(tmp_path / "dist"), str(src)], capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    (wheel,) = (tmp_path / "dist").glob("megatrain_nb-*.whl")
    return zipfile.ZipFile(wheel), p.stdout + p.stderr


@pytest.mark.slow
def test_wheel_carries_the_built_labextension_without_node(tmp_path):
    whl, log = _build(_tree(tmp_path, built=True), tmp_path)
    names = whl.namelist()
    data = [n for n in names if LABEXT in n]
    assert any(n.endswith(LABEXT + "package.json") for n in data)
    assert any(n.endswith(LABEXT + "static/remoteEntry.0123abcd.js") for n in data)
    (install,) = [n for n in data if n.endswith(LABEXT + "install.json")]
    assert json.loads(whl.read(install))["packageName"] == "megatrain-nb"  # this wheel provides it
    (cfg,) = [n for n in names if n.endswith("etc/jupyter/jupyter_server_config.d/megatrain_nb.json")]
    assert json.loads(whl.read(cfg))["ServerApp"]["jpserver_extensions"] == {"megatrain_nb.lab": True}
    assert "carries the prebuilt JupyterLab extension" in log


@pytest.mark.slow
def test_without_node_the_wheel_builds_without_the_extension_and_says_so(tmp_path):
    whl, log = _build(_tree(tmp_path, built=False), tmp_path)
    assert not [n for n in whl.namelist() if LABEXT in n]
    assert any(n.endswith("megatrain_nb/cli/__init__.py") for n in whl.namelist())
    for shipped in ("assets/chat/conversations.jsonl", "assets/chat/tokenizer/tokenizer.json",
                    "assets/chat/tokenizer/chat_template.jinja",   # the offline SFT material
                    "assets/chat/preferences.jsonl"):   # and DPO's
        assert any(n.endswith("megatrain_nb/" + shipped) for n in whl.namelist()), shipped
    assert "MEGATRAIN_NB_BUILD_LABEXTENSION=1 builds it" in log and "WITHOUT the JupyterLab extension" in log
    shutil.rmtree(tmp_path / "dist")
    whl, log = _build(_tree(tmp_path / "asked", built=False), tmp_path, MEGATRAIN_NB_BUILD_LABEXTENSION="1")
    assert not [n for n in whl.namelist() if LABEXT in n]
    assert "cannot be built here: Node.js >= 20 is not on PATH" in log


def test_pyproject_names_nothing_unpublished_and_an_spdx_licence():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    project = meta["project"]
    assert project["license"] == "Apache-2.0"
    assert any(r.startswith("setuptools>=77") for r in meta["build-system"]["requires"])
    extras = [r for reqs in project["optional-dependencies"].values() for r in reqs]
    assert not [r for r in extras if r.lower().replace("_", "-").startswith("megatrain-nb")], extras


@pytest.mark.slow
def test_an_editable_install_carries_it_too(tmp_path):
    """``pip install -e ".[lab]"`` from a checkout whose extension is built."""
    src = _tree(tmp_path, built=True)
    out = tmp_path / "editable"
    code = ("import sys; from setuptools import build_meta as b; "
            f"print('WHEEL', b.build_editable({str(out)!r}))")
    p = subprocess.run([sys.executable, "-c", code], cwd=src, capture_output=True, text=True, timeout=300,
                       env={k: v for k, v in os.environ.items() if not k.startswith("MEGATRAIN_NB_")})
    assert p.returncode == 0, p.stderr[-2000:]
    (wheel,) = out.glob("*.editable-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert any(n.endswith(LABEXT + "package.json") for n in names), names
    assert any(n.endswith("etc/jupyter/jupyter_server_config.d/megatrain_nb.json") for n in names)
