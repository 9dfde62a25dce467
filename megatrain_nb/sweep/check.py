"""Check one registered causal-LM architecture against Hugging Face autograd.

:func:`check` builds the architecture's tiny config (:mod:`megatrain_nb.tiny_configs`), runs the model's own
forward and backward (the reference: cross-entropy of its logits against the next token), then
the streaming engine at checkpoint intervals 1 and 2 and as a layer-major window of two
micro-batches, and compares the loss and every parameter's gradient. The result says one of:

* ``supported``: every mode matched;
* ``refused``: the engine declined the model with a stated reason (a TypeError or
  NotImplementedError naming what it does not support);
* ``failing``: the engine ran and the numbers differ, or it crashed;
* ``not a decoder stack``: the registry entry is a multimodal top-level class, or a
  speculative-decoding assistant that runs only beside its target model;
* ``not built``: transformers itself cannot build or run the tiny model on a CPU (the reason).
"""
from __future__ import annotations

import copy
import traceback
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional

from megatrain_nb.tiny_configs import tiny_config

SUPPORTED, REFUSED, FAILING, NOT_DECODER, NOT_BUILT = (
    "supported", "refused", "failing", "not a decoder stack", "not built")

#: Encoder models registered as causal LMs (run with ``is_decoder=True``).
ENCODER_AS_DECODER = {"bert", "bert-generation", "big_bird", "camembert", "data2vec-text", "electra", "ernie",
                      "megatron-bert", "rembert", "roberta", "roberta-prelayernorm", "roc_bert", "roformer",
                      "xlm-roberta", "xlm-roberta-xl", "xmod", "xlm", "xlnet", "reformer"}
#: The decoder half of an encoder-decoder model, registered as a causal LM.
ENCODER_DECODER_PART = {"bart", "bigbird_pegasus", "blenderbot", "blenderbot-small", "marian", "mbart", "mvp",
                        "pegasus", "plbart", "prophetnet", "trocr", "whisper", "musicgen", "musicgen_melody"}

SEQ = 8
BATCH = 2
LOSS_RTOL = 1e-5
GRAD_RTOL = 1e-4
MODES = ("interval 1", "interval 2", "window of 2")
TILED = "tiles of 3"   # not a default mode: check(mt, modes=(TILED,)) sweeps engine/compute/tiling.py


@dataclass
class Result:
    model_type: str
    architecture: str
    kind: str   # "decoder-only", "encoder as decoder", "decoder of encoder-decoder", "multimodal", "assistant"
    status: str
    reason: str = ""
    modes: Dict[str, str] = field(default_factory=dict)   # mode -> "ok" / what differed
    layers: Optional[int] = None

    def to_dict(self) -> dict:
        return asdict(self)


def registry() -> Dict[str, str]:
    """model type -> causal-LM class name, for the installed transformers."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return dict(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def kind_of(model_type: str, architecture: str) -> str:
    if architecture.endswith("ForConditionalGeneration"):
        return "multimodal"
    if "Assistant" in architecture:
        return "assistant"
    if model_type in ENCODER_DECODER_PART:
        return "decoder of encoder-decoder"
    if model_type in ENCODER_AS_DECODER:
        return "encoder as decoder"
    return "decoder-only"


def short_error(e: BaseException) -> str:
    msg = " ".join(line.strip() for line in str(e).strip().splitlines())
    return f"{type(e).__name__}: {msg[:300]}"


def _batches(vocab: int, n: int, seed: int = 0):
    import torch

    g = torch.Generator().manual_seed(seed)
    hi = max(5, min(vocab - 2, 100))
    return [torch.randint(4, hi, (BATCH, SEQ), generator=g) for _ in range(n)]


def reference(model, batches):
    """Hugging Face autograd: the summed next-token cross-entropy of the model's own logits over
    ``batches``, divided by the target count; returns (loss, {name: grad})."""
    import torch
    import torch.nn.functional as F

    ref = copy.deepcopy(model)
    n = sum(b[:, 1:].numel() for b in batches)
    total = 0.0
    for ids in batches:
        logits = ref(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits[:, :-1].float()
        part = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1), reduction="sum")
        (part / n).backward()
        total += float(part.detach())
    grads = {name: (p.grad if p.grad is not None else torch.zeros_like(p)) for name, p in ref.named_parameters()}
    return total / n, grads


def compare(engine, loss: float, ref_loss: float, ref_grads) -> str:
    """'ok', or what differs (loss, names, the worst gradient)."""
    if abs(loss - ref_loss) > LOSS_RTOL * max(abs(ref_loss), 1e-6):
        return f"loss {loss:.7g} vs {ref_loss:.7g}"
    seen, worst, worst_name = set(), 0.0, ""
    for name, g in engine.named_gradients():
        seen.add(name)
        r = ref_grads.get(name)
        if r is None:
            continue
        err = float((g.float() - r.float()).norm()) / (float(r.float().norm()) + 1e-6)
        if err > worst:
            worst, worst_name = err, name
    if seen != set(ref_grads):
        diff = sorted(seen ^ set(ref_grads))
        return f"parameter names differ: {diff[:4]}"
    if worst > GRAD_RTOL:
        return f"gradient of {worst_name}: relative error {worst:.2e}"
    return "ok"


def engine_parts():
    """``(EngineConfig, StreamingEngine, units, vision)`` of the engine, imported here only: the
    sweep's table and ``megatrain-nb models`` stay free of torch until a check runs."""
    from megatrain_nb.engine import EngineConfig, StreamingEngine, units, vision   # light: no torch for --help

    return EngineConfig, StreamingEngine, units, vision


def _as_batch(b) -> dict:
    """A batch of the sweep as the engine takes it: token ids (all attended), or a dict as it is
    (an image-text batch: its labels and images inside)."""
    import torch

    return b if isinstance(b, dict) else {"input_ids": b, "attention_mask": torch.ones_like(b)}


def run_mode(model, mode: str, batches, ref) -> str:
    EngineConfig, StreamingEngine, _, _ = engine_parts()
    k = 2 if mode == "interval 2" else 1
    tiles = {"tile_tokens": 3} if mode == TILED else {}   # a layer's MLP over the sequence in tiles of 3 tokens
    engine = StreamingEngine(copy.deepcopy(model), EngineConfig(device="cpu", checkpoint_interval=k, overrides=tiles))
    try:
        first = batches[0]
        if mode == "window of 2":
            out = engine.forward_backward([_as_batch(b) for b in batches])
        elif isinstance(first, dict):   # an image-text batch: its labels and images inside
            out = engine.forward_backward(first)
        else:
            out = engine.forward_backward(first, attention_mask=_as_batch(first)["attention_mask"])
        return compare(engine, out.loss, *ref)
    finally:
        engine.close()


def check(model_type: str, modes=MODES) -> Result:
    """Build ``model_type``'s tiny model and compare the engine with Hugging Face autograd."""
    import torch
    from transformers import AutoModelForCausalLM

    architecture = registry().get(model_type, "?")
    kind = kind_of(model_type, architecture)
    res = Result(model_type, architecture, kind, SUPPORTED)
    if kind == "multimodal":
        res.status = NOT_DECODER
        res.reason = (f"{architecture} is a multimodal top-level class (vision/audio towers around a language "
                      "model); train its text model (the …ForCausalLM of config.get_text_config()) instead, "
                      "or the whole model where the image-text-to-text table lists it as supported")
        return res
    if kind == "assistant":
        res.status = NOT_DECODER
        res.reason = (f"{architecture} is a speculative-decoding assistant: its forward needs its target model's "
                      "key/value states (shared_kv_states), so it is not a language model trained on its own")
        return res
    try:
        cfg = tiny_config(model_type)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
        if hasattr(model, "set_default_language") and getattr(cfg, "languages", None):   # X-MOD's adapters
            model.set_default_language(cfg.languages[0])
        res.layers = _num_layers(model)
    except Exception as e:  # noqa: BLE001 - the reason is the result
        res.status = NOT_BUILT
        default = _default_build_error(model_type)
        if default is not None:
            res.reason = f"transformers cannot build it from its own default config: {default}"
        else:
            res.status, res.reason = FAILING, f"the tiny-config rules do not fit it: {short_error(e)}"
        return res
    try:
        vocab = model.get_input_embeddings().num_embeddings
        single = _batches(vocab, 1)
        window = _batches(vocab, 2, seed=1)
        refs = {"single": reference(model, single), "window": reference(model, window)}
    except Exception as e:  # noqa: BLE001
        res.status, res.reason = FAILING, f"the tiny model does not run in transformers (the rules?): {short_error(e)}"
        refusal = _engine_refusal(model)
        if refusal:   # the engine declines it anyway: that is the result
            res.status, res.reason = REFUSED, refusal
        return res
    return run_modes(res, model, modes, {"single": (single, refs["single"]), "window": (window, refs["window"])})


def run_modes(res: Result, model, modes, cases: dict) -> Result:
    """``res`` with each mode's outcome: the engine against its reference (``cases``: "single" and
    "window", each (batches, (loss, grads))); refused, failing or supported as the modes say."""
    for mode in modes:
        batches, ref = cases["window" if mode == "window of 2" else "single"]
        try:
            res.modes[mode] = run_mode(model, mode, batches, ref)
        except (TypeError, NotImplementedError) as e:
            if is_refusal(e):
                res.status, res.reason = REFUSED, str(e).strip().splitlines()[0]
                res.modes[mode] = "refused"
                return res
            res.modes[mode] = short_error(e) + " @ " + where_raised(e)
        except Exception as e:  # noqa: BLE001
            res.modes[mode] = short_error(e) + " @ " + where_raised(e)
    bad = {m: v for m, v in res.modes.items() if v != "ok"}
    if bad:
        res.status = FAILING
        res.reason = "; ".join(f"{m}: {v}" for m, v in bad.items())
    return res


def _engine_refusal(model) -> Optional[str]:
    """The engine's stated refusal of ``model`` (one step on a batch), or None."""
    try:
        ids = _batches(model.get_input_embeddings().num_embeddings, 1)[0]
        run_mode(model, "interval 1", [ids], (0.0, {}))
    except (TypeError, NotImplementedError) as e:
        if is_refusal(e):
            return str(e).strip().splitlines()[0]
    except Exception:  # noqa: BLE001 - not a refusal
        pass
    return None


def _default_build_error(model_type: str) -> Optional[str]:
    """Why transformers cannot build ``model_type`` from its default config (on the meta
    device: no memory), or None when it can."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        with torch.device("meta"):
            AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type))
    except Exception as e:  # noqa: BLE001
        return short_error(e)
    return None


def is_refusal(e: BaseException) -> bool:
    """A refusal the engine states on purpose (raised from megatrain_nb with a reason)."""
    tb = traceback.extract_tb(e.__traceback__)
    return bool(tb) and "megatrain_nb" in tb[-1].filename and "supports" in str(e) or "not supported" in str(e)


def where_raised(e: BaseException) -> str:
    tb = traceback.extract_tb(e.__traceback__)
    if not tb:
        return "?"
    f = tb[-1]
    return f"{f.filename.rsplit('/', 2)[-2]}/{f.filename.rsplit('/', 1)[-1]}:{f.lineno}"


def _num_layers(model) -> Optional[int]:
    units = engine_parts()[2]
    try:
        return len(units.find_layer_list(model)[2])
    except Exception:  # noqa: BLE001
        return None


def sweep(model_types: Optional[List[str]] = None, modes=MODES, progress=None) -> List[Result]:
    out = []
    for mt in model_types or list(registry()):
        r = check(mt, modes)
        out.append(r)
        if progress is not None:
            progress(r)
    return out
