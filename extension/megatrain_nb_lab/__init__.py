"""The prebuilt JupyterLab frontend of megatrain_nb (status bar item and sessions sidebar).

The server side is ``megatrain_nb.lab`` in the main package; this wheel ships the
labextension under ``share/jupyter/labextensions/megatrain-nb-lab`` and the config file
that enables that server extension.
"""

try:
    from ._version import __version__
except ImportError:  # running from a source tree that was never built
    import warnings

    warnings.warn("Importing 'megatrain_nb_lab' outside a proper installation.", stacklevel=2)
    __version__ = "dev"


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    return [{"src": "labextension", "dest": "megatrain-nb-lab"}]
