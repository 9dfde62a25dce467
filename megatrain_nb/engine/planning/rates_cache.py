"""The machine's measured rates, cached on disk: where the file lives, its name, how it is
written, and the checks that make it trustworthy (a regular file of this user's that nobody else
can write, opened without following links or blocking; every value a plausible rate). No torch:
the planner, the plan picker and the estimator read it (engine/measure.py writes it, measuring
with torch)."""
from __future__ import annotations

import hashlib
import json
import os
import socket
import stat
import tempfile
import warnings
from typing import Optional

from megatrain_nb.threads import with_index

from ..tiers.diskspace import filesystem_of
from .rates import MachineRates, check_rates

CACHE_VERSION = 5   # 2: compute_beside_disk; 3: measured on the compute's own threads; 4: the fused update;
#                     5: compute_beside_disk a mean over a stretch (a median of calls hid the I/O bursts), the disk's cost a file


def device_name(device=None) -> str:
    """The cache's name of ``device``: "cpu", or "cuda:N <the GPU's name>" (torch is asked only
    for a GPU, or for the default device, which is a GPU where one is present)."""
    text = None if device is None else str(device)
    if text == "cpu":
        return "cpu"
    import torch   # (a GPU's name and index: torch only when one may be meant)

    try:
        dev = torch.device(text if text is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    except (RuntimeError, TypeError):
        raise ValueError(f"measure_machine: device {device!r} is neither cpu nor cuda[:N]") from None
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"measure_machine: device {device!r} asked for, but CUDA is not available here; "
                             "pass device='cpu' or leave it out")
        dev = with_index(dev)
        return f"{dev} {torch.cuda.get_device_name(dev)}"
    if dev.type != "cpu":
        raise ValueError(f"measure_machine: device {device!r} is neither cpu nor cuda")
    return "cpu"


def cache_dir() -> str:
    """``$MEGATRAIN_NB_CACHE``, else ``~/.cache/megatrain_nb``: the built-in corpus's folder too."""
    return os.environ.get("MEGATRAIN_NB_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "megatrain_nb")


def cache_key(device_name: str, fs: dict, quick: bool = False) -> str:
    """The cache file's name: the host, the device and the filesystem (mount, type, device)."""
    host = socket.gethostname()
    text = json.dumps([CACHE_VERSION, host, device_name, fs.get("mount"), fs.get("type"), fs.get("device")])
    clean = "".join(c if c.isalnum() or c in "-_" else "_" for c in host)[:40]
    return f"machine-{clean}-{hashlib.sha256(text.encode()).hexdigest()[:12]}" + ("-quick" if quick else "")


#: A cache file is a few KiB; one larger than this is not ours.
CACHE_MAX_BYTES = 1 << 20


class CacheRefused(ValueError):
    """The cached rates file is not one this user may trust, or its values are not rates."""


def _read_private(path: str) -> str:
    """The text of ``path`` if it is a regular file owned by this user that nobody else can write;
    opened without following a link and without blocking (a FIFO at the path returns at once), then
    checked on the open descriptor (nothing can be swapped in between). Raises CacheRefused."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
    except OSError as e:
        if os.path.islink(path):
            raise CacheRefused("it is a symbolic link (a cache file is never followed)") from None
        raise CacheRefused(f"it cannot be opened ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise CacheRefused("it is not a regular file")
        if hasattr(os, "geteuid") and st.st_uid != os.geteuid():
            raise CacheRefused(f"it is owned by user id {st.st_uid}, not by this user ({os.geteuid()})")
        if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            raise CacheRefused(f"others can write it (mode {stat.S_IMODE(st.st_mode):04o})")
        if st.st_size > CACHE_MAX_BYTES:
            raise CacheRefused(f"it holds {st.st_size} bytes, more than a cache file's {CACHE_MAX_BYTES}")
        with os.fdopen(os.dup(fd), "rb") as f:
            return f.read(CACHE_MAX_BYTES + 1).decode("utf-8")
    finally:
        os.close(fd)


def load_cached(path: str, then: str = "measuring again") -> Optional[MachineRates]:
    """The cached rates, or None: no file, or one refused with a warning naming it, why, and
    ``then`` (what happens instead). Refused: a file that is not a regular file owned by this user
    and writable by nobody else (:func:`_read_private`: a link, a FIFO, another user's file), not
    JSON of this cache's version, or with a value that is not a plausible rate (``rates.check_rates``)."""
    if not os.path.lexists(path):
        return None
    try:
        d = json.loads(_read_private(path), parse_constant=lambda c: float(c))
        if not isinstance(d, dict) or d.get("version") != CACHE_VERSION:
            v = d.get("version") if isinstance(d, dict) else None
            raise CacheRefused(f"version {v!r}, not {CACHE_VERSION}")
        bad = check_rates(d.get("rates"))
        if bad:
            raise CacheRefused("values that are not plausible rates: " + "; ".join(bad[:6])
                               + (f" (and {len(bad) - 6} more)" if len(bad) > 6 else ""))
        return MachineRates.from_dict(d["rates"])
    except (OSError, ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError, RecursionError) as e:
        warnings.warn(f"measure_machine: the cached rates {path} cannot be read ({e}); {then}", stacklevel=3)
        return None


def save_cached(path: str, rates: MachineRates) -> None:
    """Write the cache file atomically (a temporary file in the same folder, then a rename)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".machine-", suffix=".tmp", dir=os.path.dirname(path))
    try:
        with os.fdopen(fd, "w") as f:
            json.dump({"version": CACHE_VERSION, "rates": rates.to_dict()}, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def cached_rates(device=None, offload_dir=None) -> Optional[MachineRates]:
    """The rates ``mt.measure_machine`` cached for this device and ``offload_dir``'s filesystem, or
    None: never measures, never raises (a built engine's ``.prediction`` and a profile's CPU rates
    read this; a damaged file warns)."""
    try:
        name = device_name(device)
        root = os.fspath(offload_dir) if offload_dir is not None else tempfile.gettempdir()
        if not os.path.isdir(root):   # (the disk tier's folder not made yet: its parent's filesystem)
            root = os.path.dirname(os.path.abspath(root)) or "."
            if not os.path.isdir(root):
                return None
        return load_cached(os.path.join(cache_dir(), cache_key(name, filesystem_of(root)) + ".json"),
                           then="the planner's rules decide the plan and no step is predicted (measure again: "
                                "megatrain-nb machine --refresh, or mt.measure_machine(refresh=True))")
    except (OSError, ValueError):
        return None


__all__ = ["CACHE_VERSION", "CacheRefused", "cache_dir", "cache_key", "cached_rates", "device_name", "load_cached",
           "save_cached"]
