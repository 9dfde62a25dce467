"""Build hook: the JupyterLab extension's prebuilt frontend ships inside the megatrain-nb wheel.

Everything else is in pyproject.toml. Like plotly's wheel, ours carries its labextension as data
files, so one ``pip install megatrain-nb`` gives JupyterLab the sidebar and status-bar item:

    share/jupyter/labextensions/megatrain-nb-lab/   package.json, static/*, install.json
    etc/jupyter/jupyter_server_config.d/megatrain_nb.json   enables megatrain_nb.lab

Node.js (>= 20) is needed only to *build* the frontend (``extension/``, with jlpm from
jupyterlab), never to install the wheel. When building:

- an already built ``extension/megatrain_nb_lab/labextension`` is used as it is;
- else, with ``MEGATRAIN_NB_BUILD_LABEXTENSION=1`` (``scripts/build_wheel.sh`` and
  ``scripts/setup.sh lab`` set it), it is built first: ``jlpm install``, ``jlpm build:prod``
  (minutes, from the npm registry: never as a side effect of a plain ``pip install``);
- else the wheel is built without it and a warning says so (the Python side works, the
  JupyterLab sidebar is absent). ``MEGATRAIN_NB_REQUIRE_LABEXTENSION=1`` turns that into an
  error (release builds).
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.dist import Distribution as _Distribution

ROOT = Path(__file__).resolve().parent
EXT = ROOT / "extension"
BUILT = EXT / "megatrain_nb_lab" / "labextension"
LABEXT = "share/jupyter/labextensions/megatrain-nb-lab"
SERVER_CONFIG = "etc/jupyter/jupyter_server_config.d"


def _say(msg: str) -> None:
    print(f"megatrain-nb build: {msg}", file=sys.stderr, flush=True)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _node_major():
    node = shutil.which("node")
    if not node:
        return None
    try:
        out = subprocess.run([node, "--version"], capture_output=True, text=True, timeout=30).stdout
        return int(out.strip().lstrip("v").split(".")[0])
    except (OSError, ValueError, subprocess.SubprocessError):
        return None


def _jlpm():
    """jlpm (the yarn that jupyterlab bundles): on PATH, or runnable from this interpreter."""
    found = shutil.which("jlpm")
    if found:
        return [found]
    import importlib.util

    for module in ("jupyter_builder.jlpm", "jupyterlab.jlpmapp"):  # where jupyterlab versions keep it
        try:
            if importlib.util.find_spec(module) is not None:
                return [sys.executable, "-c", f"import sys; from {module} import main; sys.exit(main())"]
        except ImportError:
            continue
    return None


def build_labextension() -> bool:
    """Make sure ``extension/megatrain_nb_lab/labextension`` exists; False when it cannot be built."""
    if (BUILT / "package.json").is_file():
        return True
    wanted = _env_flag("MEGATRAIN_NB_BUILD_LABEXTENSION") or _env_flag("MEGATRAIN_NB_REQUIRE_LABEXTENSION")
    if not (EXT / "package.json").is_file():
        return False
    if not wanted:
        _say(f"the JupyterLab extension is not built ({BUILT} is missing); MEGATRAIN_NB_BUILD_LABEXTENSION=1 "
             "builds it (needs Node.js >= 20), as do scripts/build_wheel.sh and scripts/setup.sh lab")
        return False
    major, jlpm = _node_major(), _jlpm()
    if major is None or major < 20 or jlpm is None:
        why = ("Node.js >= 20 is not on PATH" if major is None or major < 20
               else "jlpm (pip install jupyterlab) is not available")
        _say(f"the JupyterLab extension is not built and cannot be built here: {why}")
        return False
    for args in (["install", "--immutable"], ["build:prod"]):
        _say(f"building the JupyterLab extension: jlpm {' '.join(args)} (in {EXT})")
        subprocess.run(jlpm + args, cwd=EXT, check=True)
    return (BUILT / "package.json").is_file()


def labextension_data_files() -> list:
    """(target folder, [files]) pairs for the built labextension, plus our install.json."""
    out = {}
    for f in sorted(BUILT.rglob("*")):
        if f.is_file():
            target = Path(LABEXT) / f.parent.relative_to(BUILT)
            out.setdefault(str(target), []).append(str(f.relative_to(ROOT)))
    out.setdefault(LABEXT, []).append("jupyter-config/install.json")
    return sorted(out.items())


def data_files() -> list:
    """The server-extension config, and the labextension when it is (or can now be) built. Only a
    wheel build (regular or editable) builds it; metadata and sdist steps just look."""
    files = [(SERVER_CONFIG, ["jupyter-config/jupyter_server_config.d/megatrain_nb.json"])]
    if not any(cmd in sys.argv for cmd in ("bdist_wheel", "editable_wheel")):
        return files + (labextension_data_files() if (BUILT / "package.json").is_file() else [])
    if build_labextension():
        _say(f"the wheel carries the prebuilt JupyterLab extension ({BUILT})")
        return files + labextension_data_files()
    if _env_flag("MEGATRAIN_NB_REQUIRE_LABEXTENSION"):
        raise SystemExit("megatrain-nb build: MEGATRAIN_NB_REQUIRE_LABEXTENSION=1 but the JupyterLab "
                         "extension could not be built (needs Node.js >= 20 and jlpm)")
    _say("building WITHOUT the JupyterLab extension (the Python package and the notebook dashboard "
         "work; the JupyterLab sidebar needs the extension built: see above)")
    return files


class Distribution(_Distribution):
    def has_data(self):
        # setuptools' editable_wheel installs data files only if the distribution answers
        # has_data() (it otherwise has only has_data_files()): without this, `pip install -e .`
        # would leave the labextension out.
        return self.has_data_files()


setup(data_files=data_files(), distclass=Distribution)
