"""Where a model named by a string lives: a local folder, or a Hugging Face Hub id.

Every entry point that takes a model by name (``StreamingEngine.from_pretrained``,
``mt.Session("org/name")``, ``mt.Trainer(model="org/name")`` and the ``model:`` field of
``megatrain-nb train``) calls :func:`resolve_model` once and then streams the safetensors
shards of the folder it returns, unit by unit, exactly as for a folder the user saved.

A hub id is fetched with ``huggingface_hub.snapshot_download`` restricted to the config,
tokenizer and safetensors files (``pytorch_model.bin`` and other formats are never
downloaded), with its progress bars, into the usual cache (``HF_HOME`` / ``HF_HUB_CACHE``).
``HF_HUB_OFFLINE=1`` (or ``TRANSFORMERS_OFFLINE=1``) uses the cache only. ``revision`` is a
branch, tag or commit; ``token`` defaults to huggingface_hub's own (``HF_TOKEN`` or
``hf auth login``).

Example::

    >>> from megatrain_nb.hub import resolve_model
    >>> resolve_model("Qwen/Qwen2.5-0.5B")          # doctest: +SKIP
    '/root/.cache/huggingface/hub/models--Qwen--Qwen2.5-0.5B/snapshots/060db6.../'
"""
from __future__ import annotations

import glob
import os
import re
from pathlib import Path
from typing import Optional, Union

__all__ = ["ALLOW_PATTERNS", "ModelNotFoundError", "is_hub_id", "resolve_model"]


class ModelNotFoundError(FileNotFoundError, ValueError):
    """``model=`` names neither a local folder nor a Hub repo this process can read.

    Both a ``FileNotFoundError`` (nothing there) and a ``ValueError`` (a bad argument), so code
    that caught either before hub ids were accepted still catches it."""

# What training needs from a repo: config, tokenizer and safetensors weights. Everything else
# (pytorch_model.bin, onnx/, gguf, flax/tf weights, images) is left on the Hub.
ALLOW_PATTERNS = [
    "config.json", "generation_config.json",
    "*.safetensors", "model.safetensors.index.json",
    "tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "*.tiktoken", "chat_template.*",
]

# "name" or "org/name" as the Hub spells repo ids (no leading '.', '-', no '..', no '--').
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}$")


def is_hub_id(name: str) -> bool:
    """Whether ``name`` is spelled like a Hub repo id (it may still not exist)."""
    return bool(_REPO_ID.match(name)) and ".." not in name and "--" not in name and not name.endswith(".")


def resolve_model(model: Union[str, os.PathLike], *, revision: Optional[str] = None,
                  token: Union[str, bool, None] = None) -> str:
    """A local folder with ``config.json`` and safetensors weights for ``model``.

    ``model`` is an existing folder (returned as is) or a Hub id (downloaded, or found in the
    cache when offline). Anything else raises :class:`ModelNotFoundError` naming the value; a repo
    whose weights are only in ``.bin`` files raises ``ValueError`` saying how to convert it.
    """
    path = Path(model).expanduser()
    if path.exists():
        if revision is not None:
            raise ValueError(f"revision={revision!r} was given with the local folder {str(path)!r}; "
                             "a revision only applies to a Hub id")
        return str(path)
    name = os.fspath(model)
    if not is_hub_id(name):
        raise ModelNotFoundError(f"model={name!r} is not a local model folder (no such folder) nor a Hugging Face "
                                 "Hub id ('org/name'); pass an existing folder (config.json + *.safetensors) or a "
                                 "hub id")
    folder = _download(name, revision=revision, token=token)
    _check_folder(folder, name, revision, token)
    return folder


def _offline() -> bool:
    return any(os.environ.get(v, "").strip().upper() in ("1", "ON", "YES", "TRUE")
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def _cache_dir() -> Optional[str]:
    """The hub cache as the environment says *now* (huggingface_hub reads it once, at import,
    so a notebook that sets HF_HOME after importing transformers would otherwise be ignored)."""
    if os.environ.get("HF_HUB_CACHE"):
        return os.path.expanduser(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return os.path.join(os.path.expanduser(os.environ["HF_HOME"]), "hub")
    return None


def _download(name: str, *, revision, token) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    offline = _offline()
    cache = _cache_dir()
    where = f"{name!r}" + (f" at revision {revision!r}" if revision else "")
    try:
        return snapshot_download(name, revision=revision, token=token, cache_dir=cache,
                                 local_files_only=offline, allow_patterns=ALLOW_PATTERNS)
    except LocalEntryNotFoundError as e:
        if offline:
            raise ModelNotFoundError(
                f"model={where} is not a local model folder and not in the Hugging Face cache "
                f"{cache or 'default (~/.cache/huggingface/hub)'}, and HF_HUB_OFFLINE is set: download it "
                "once with network access (or unset HF_HUB_OFFLINE), or pass a local folder") from e
        raise ModelNotFoundError(f"model={where}: the Hugging Face Hub could not be reached and the model is "
                                f"not cached ({e})") from e
    except GatedRepoError as e:
        raise ModelNotFoundError(f"model={where} is gated on the Hugging Face Hub: accept its licence on the "
                                "model page, then pass token=... or set HF_TOKEN") from e
    except RevisionNotFoundError as e:
        raise ModelNotFoundError(f"model={name!r}: revision {revision!r} does not exist on the Hub") from e
    except RepositoryNotFoundError as e:
        raise ModelNotFoundError(f"model={name!r} is not a local model folder nor a Hugging Face Hub repo "
                                "(a private repo needs token=... or HF_TOKEN)") from e
    except HfHubHTTPError as e:
        raise ModelNotFoundError(f"model={where}: the Hugging Face Hub answered {e}") from e


def _check_folder(folder: str, name: str, revision, token) -> None:
    if not os.path.isfile(os.path.join(folder, "config.json")):
        raise FileNotFoundError(f"model={name!r}: the repo has no config.json ({folder}); it is not a "
                                "transformers model")
    if glob.glob(os.path.join(folder, "*.safetensors")):
        return
    bins = [os.path.basename(f) for f in glob.glob(os.path.join(folder, "*.bin"))]
    if not bins and not _offline():
        try:  # the .bin files were not downloaded (not in ALLOW_PATTERNS): ask the Hub what it has
            from huggingface_hub import list_repo_files

            bins = [f for f in list_repo_files(name, revision=revision, token=token) if f.endswith(".bin")]
        except Exception:  # noqa: BLE001 - only improves the message below
            bins = []
    found = f"its weights are only in {', '.join(sorted(bins)[:3])}" if bins else "it has no *.safetensors weights"
    raise ValueError(
        f"model={name!r}: {found}; megatrain-nb streams safetensors only (it never unpickles .bin files). "
        "Convert once: AutoModelForCausalLM.from_pretrained(name).save_pretrained(folder) writes safetensors; "
        "then pass that folder, or use a revision of the repo that has *.safetensors")
