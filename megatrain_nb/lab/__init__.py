"""JupyterLab integration: the Jupyter server extension (``handlers.py``), which reads the
run-control channel (``megatrain_nb.channel``: heartbeats and inboxes) for the sidebar.

The frontend (status bar item and sidebar) is the ``megatrain-nb-lab`` labextension, built
from ``extension/`` and shipped prebuilt inside the megatrain-nb wheel (see ``setup.py``), with
the config file that enables this server extension; ``extension/`` also builds it alone as the
``megatrain_nb_lab`` wheel. Importing this package stays cheap: the server imports ``handlers``
when it loads the extension.
"""

from __future__ import annotations

from typing import Any


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": "megatrain_nb.lab"}]


def _load_jupyter_server_extension(server_app: Any) -> None:
    # light: jupyter_server and tornado away from importing this package (done to find the extension)
    from megatrain_nb.lab.handlers import setup_handlers

    setup_handlers(server_app.web_app)
    server_app.log.info("megatrain_nb: session endpoints at /megatrain-nb/sessions")


# the pre-2.0 name, still looked up by some tools
load_jupyter_server_extension = _load_jupyter_server_extension
