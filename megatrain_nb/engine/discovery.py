"""Where a causal LM keeps its base model and decoder stack, found from the module tree.

The name in ``base_model_prefix`` is not always the attribute the model uses (a model may keep
its base model under another name), and the head code of some models reaches the decoder stack
through a path below the base model (``self.model.decoder(...)``). So the base model is the
causal LM's direct child that holds the layer list, and the *stack path* is every module from
the base model down to the layer list's parent: the modules the head code may call to get the
final hidden states.
"""
from __future__ import annotations

from typing import List, Tuple

from torch import nn

SUPPORTED_HINT = ("decoder-only *ForCausalLM models from transformers (Llama, Qwen2, Mistral, GPT-2, "
                  "Gemma 2, Phi-3, Mixtral and other families with a decoder layer list)")


def find_base_model(model: nn.Module, layers: nn.ModuleList) -> Tuple[str, nn.Module]:
    """The causal LM's direct child holding ``layers``: (attribute name, module)."""
    prefix = getattr(model, "base_model_prefix", "")
    child = model._modules.get(prefix) if prefix else None
    if child is not None and _holds(child, layers):
        return prefix, child
    for name, child in model.named_children():
        if child is not layers and _holds(child, layers):
            return name, child
    raise TypeError(f"{type(model).__name__} keeps its decoder layer list outside a base model; the engine "
                    "supports causal LMs whose layers live in a base model (model.model.layers, "
                    "model.transformer.h, ...).")


def stack_path(base: nn.Module, layers: nn.ModuleList) -> List[nn.Module]:
    """The modules from ``base`` down to the parent of ``layers`` (``base`` first)."""
    for name, mod in base.named_modules():
        if mod is layers:
            path, cur = [base], base
            for part in name.split(".")[:-1]:
                cur = cur._modules[part]
                path.append(cur)
            return path
    return [base]


def _holds(module: nn.Module, target: nn.Module) -> bool:
    return any(m is target for m in module.modules())


def locate(model: nn.Module) -> Tuple[str, nn.Module, List[nn.Module]]:
    """(base model's attribute name, the base model, its stack path) of a causal LM whose layer
    list has not yet been replaced by proxies."""
    _, _, layers = find_layer_list(model)
    name, base = find_base_model(model, layers)
    return name, base, stack_path(base, layers)


def modules_after_layers(model: nn.Module, layers: nn.ModuleList) -> List[nn.Module]:
    """The base model's modules registered after the layer list, at every level of the stack
    path (the final norm of ``model.model.norm`` and of ``model.model.decoder.layer_norm``).
    Embedding modules (an attribute name with "embed") run before the layers wherever they are
    registered (``layernorm_embedding``, ``embed_positions`` of the BART family)."""
    _, base = find_base_model(model, layers)
    path = stack_path(base, layers)
    out = []
    for parent, child in zip(path, path[1:] + [layers]):
        seen = False
        for name, mod in parent.named_children():
            if mod is child:
                seen = True
            elif seen and "embed" not in name:
                out.append(mod)
    return out


def find_layer_list(model: nn.Module) -> Tuple[nn.Module, str, nn.ModuleList]:
    """The decoder layer list: of the ModuleLists holding parameters, the one nearest the top
    of the module tree, and of those the one holding the most parameters (a vision or audio
    tower's layers, deeper inside the embedding, are not the decoder's).

    Returns (parent module, attribute name, the list).
    """
    best = None
    for parent_name, parent in model.named_modules():
        depth = parent_name.count(".") + 1 if parent_name else 0
        for attr, child in parent.named_children():
            if isinstance(child, nn.ModuleList) and len(child) > 0:
                numel = sum(p.numel() for p in child.parameters())
                if numel == 0:
                    continue
                key = (-depth, numel)
                if best is None or key > best[0]:
                    best = (key, parent, attr, child)
    if best is None:
        raise TypeError(f"{type(model).__name__} has no decoder layer list; the engine supports {SUPPORTED_HINT}.")
    (_, numel), parent, attr, layers = best
    for other_attr, other in parent.named_children():   # XLM: attentions, ffns, norms in lists side by side
        if other is not layers and isinstance(other, nn.ModuleList) and len(other) == len(layers) \
                and sum(p.numel() for p in other.parameters()) >= numel // 10:
            raise TypeError(f"{type(model).__name__} keeps each layer's parts in parallel lists ({attr}, "
                            f"{other_attr}, ...) rather than one list of layers; the engine supports "
                            f"{SUPPORTED_HINT}.")
    return parent, attr, layers
