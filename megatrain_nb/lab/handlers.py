"""Jupyter server extension handlers: the sidebar's window onto the session registry.

    GET  <base_url>/megatrain-nb/sessions                -> {"sessions": [...], "time": t}
    POST <base_url>/megatrain-nb/sessions/<id>/command   {"command": "pause"|"resume"|"stop"|"lr",
                                                          "value": float|null}
         -> 202 {"id", "session_id", "command", "value", "source", "time"}
            400 bad command or value, 404 no such running session
    DELETE <base_url>/megatrain-nb/sessions/<id>         (dismiss a run that ended)
         -> 204; 404 no such session, 409 still running

Both need an authenticated Jupyter user (token or cookie; XSRF for cookie-authenticated
POSTs, as for every Jupyter API) and the "kernels" permission: read to list, write to
command. Nothing listens on a port of its own.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web

from megatrain_nb.channel.protocol import CommandError, parse_command_json
from megatrain_nb.channel.registry import (
    StillRunning,
    UnknownSession,
    dismiss_session,
    enqueue_command,
    list_sessions,
)

ROUTE = "megatrain-nb"
ROOT_SETTING = "megatrain_nb_runtime_root"
_HOST = socket.gethostname()


class _BaseHandler(APIHandler):
    # Sessions live in kernels: the same permission as the kernels API.
    auth_resource = "kernels"

    @property
    def runtime_root(self) -> Path | None:
        return self.settings.get(ROOT_SETTING)

    def _refuse(self, status: int, session_id: str, message: str) -> None:
        """Every refused command is logged (the server log is its record), then answered."""
        self.log.warning("megatrain_nb: refused a command for session %s (%d): %s", session_id, status, message)
        self._fail(status, message)

    def _fail(self, status: int, message: str) -> None:
        self.set_status(status)
        self.finish(json.dumps({"message": message, "reason": self._reason}))


ELSEWHERE_ENDED_KEPT = 120.0   # s: a run from elsewhere that ended is listed this long after its end
SEEN_SETTING = "megatrain_nb_seen_kernels"


def origin_text(s: dict) -> str:
    """Where a run not of this server's kernels comes from, in words: "python train.py (pid 4242)",
    "a kernel of another Jupyter server (pid 4242)"."""
    o = s.get("origin") if isinstance(s.get("origin"), dict) else {}
    pid = o.get("pid", s.get("pid"))
    where = f"pid {pid}" + (f" on {s['host']}" if s.get("host") and s.get("host") != _HOST else "")
    if o.get("kind") == "kernel" or (not o and s.get("kernel_id")):
        return f"a kernel of another Jupyter server ({where})"
    return f"{o.get('command') or 'a process'} ({where})"


def place_sessions(sessions: list[dict], kernel_ids: set, seen: set, now: float) -> list[dict]:
    """Each heartbeat marked ``here`` (its kernel is, or was while this server ran, one of this
    server's) or given its ``origin_text``; runs from elsewhere that ended more than
    ``ELSEWHERE_ENDED_KEPT`` seconds ago are left out (a fresh server listed a day of finished
    scripts and test runs)."""
    seen |= kernel_ids
    out = []
    for s in sessions:
        kid = s.get("kernel_id")
        s["kernel_known"] = kid in kernel_ids
        s["here"] = kid is not None and kid in seen
        if not s["here"]:
            ended = s.get("ended")
            if isinstance(ended, (int, float)) and now - ended > ELSEWHERE_ENDED_KEPT:
                continue
            s["origin_text"] = origin_text(s)
        out.append(s)
    return out


class SessionsHandler(_BaseHandler):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        sessions = list_sessions(self.runtime_root)
        paths, kernel_ids = await self._kernel_info()
        now = time.time()
        sessions = place_sessions(sessions, kernel_ids, self.settings.setdefault(SEEN_SETTING, set()), now)
        for s in sessions:
            if s.get("kernel_id") in paths:
                s["notebook"] = paths[s["kernel_id"]]
        self.finish(json.dumps({"sessions": sessions, "time": now}))

    async def _kernel_info(self) -> tuple[dict[str, str], set[str]]:
        """kernel id -> notebook path (from the session manager), and this server's kernel ids."""
        paths: dict[str, str] = {}
        try:
            for model in await self.session_manager.list_sessions():
                kid = (model.get("kernel") or {}).get("id")
                if kid and model.get("path"):
                    paths[kid] = model["path"]
        except Exception:  # noqa: BLE001 - listing still works without notebook paths
            self.log.debug("megatrain_nb: session manager unavailable", exc_info=True)
        try:
            kernel_ids = set(self.kernel_manager.list_kernel_ids())
        except Exception:  # noqa: BLE001
            kernel_ids = set()
        return paths, kernel_ids


class CommandHandler(_BaseHandler):
    @web.authenticated
    @authorized
    async def post(self, session_id: str) -> None:
        try:
            try:
                body: Any = parse_command_json(self.request.body or b"{}")
            except CommandError as e:
                raise CommandError(f"request body must be JSON, an object like {{\"command\": ..., \"value\": ...}}: "
                                   f"{e}") from None
            if not isinstance(body, dict):
                raise CommandError("request body must be a JSON object")
            record = enqueue_command(
                session_id,
                body.get("command"),
                body.get("value"),
                source="lab",
                root=self.runtime_root,
            )
        except CommandError as e:
            return self._refuse(400, session_id, str(e))
        except UnknownSession as e:
            return self._refuse(404, session_id, str(e))
        self.log.info(
            "megatrain_nb: %s %s -> session %s", record["command"], record["value"], session_id
        )
        self.set_status(202)
        self.finish(json.dumps(record))


class SessionHandler(_BaseHandler):
    @web.authenticated
    @authorized
    async def delete(self, session_id: str) -> None:
        try:
            dismiss_session(session_id, self.runtime_root)
        except UnknownSession as e:
            return self._fail(404, str(e))
        except StillRunning as e:
            return self._fail(409, str(e))
        self.set_status(204)
        self.finish()


def setup_handlers(web_app: Any, runtime_root: str | Path | None = None) -> None:
    base = web_app.settings.get("base_url", "/")
    if runtime_root is not None:
        web_app.settings[ROOT_SETTING] = Path(runtime_root)
    host = ".*$"
    web_app.add_handlers(
        host,
        [
            (url_path_join(base, ROUTE, "sessions"), SessionsHandler),
            (url_path_join(base, ROUTE, "sessions", r"([A-Za-z0-9_-]{1,64})", "command"),
             CommandHandler),
            (url_path_join(base, ROUTE, "sessions", r"([A-Za-z0-9_-]{1,64})"), SessionHandler),
        ],
    )
