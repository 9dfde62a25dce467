"""The streamed decoder's KV cache in host RAM: each full-attention layer's keys and values live
in a host buffer and cross to the device only while that layer runs.

Example::

    cache = HostKVCache(model_config, device, rows=64, tokens=1088)
    model(input_ids=ids, cache=cache, use_cache=True)      # the model's own attention fills it
    cache.moved    # {"h2d_bytes", "d2h_bytes", "crossings"}: what crossed the link

**Design.** A transformers ``DynamicCache`` built from the model's config (sliding-window and
linear-attention layers as transformers makes them, kept on the device), whose full-attention
layers (``DynamicLayer``) are :class:`HostKVLayer`: a buffer in host RAM (pinned when the device
is a GPU) of ``rows`` x heads x ``tokens`` x head size for the keys and the values, allocated at
its first update with the shapes the attention gives. A layer's ``update`` (the model's attention
calls it once per pass, as the layer runs, and layer-major decoding runs each layer once per
decoded token) copies the layer's cached entries to the device (in), writes the new token's
entries into the buffer (back), and returns the two concatenated on the device: each layer
crosses the link twice per decoded token, counted in :attr:`HostKVCache.moved` (a CPU device
counts the same bytes, which on a GPU cross the link). ``reorder_cache`` (shared prompts
replicated, finished rows dropped) reorders the host buffer's rows in place.

transformers' own ``DynamicCache(offloading=True)`` is not used: it synchronises through
``torch.cuda`` streams (no CPU device: the tests' engines run on one) and moves each layer's
whole cache back every token where only the new token's entries changed.
"""
from __future__ import annotations

from typing import Dict

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


class HostKVLayer(DynamicLayer):
    """A full-attention layer's K/V in a host buffer (see the module)."""

    def __init__(self, rows: int, tokens: int, moved: Dict[str, int]):
        super().__init__()
        self.capacity, self.moved = (int(rows), int(tokens)), moved
        self.rows = self.length = 0
        self.host_keys = self.host_values = None

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        pin = key_states.device.type == "cuda"
        rows, tokens = self.capacity
        b, h, _, d = key_states.shape
        if b > rows:
            raise ValueError(f"the host KV cache holds {rows} rows; the model gave {b}")
        self.host_keys = torch.empty((rows, h, tokens, d), dtype=key_states.dtype, pin_memory=pin)
        self.host_values = torch.empty((rows, h, tokens, value_states.shape[-1]), dtype=value_states.dtype,
                                       pin_memory=pin)
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """The layer's cached entries and the new ones, on the device; the new ones kept in host RAM."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, q, at = key_states.shape[0], key_states.shape[-2], self.length
        if at + q > self.capacity[1]:
            raise ValueError(f"the host KV cache holds {self.capacity[1]} tokens a row; the decoding reached {at + q}")
        if at and n != self.rows:
            raise ValueError(f"the host KV cache holds {self.rows} rows; the model gave {n} (reorder_cache first)")
        old_k = self.host_keys[:n, :, :at].to(self.device, non_blocking=True)      # in (pinned: asynchronous)
        old_v = self.host_values[:n, :, :at].to(self.device, non_blocking=True)
        self.host_keys[:n, :, at:at + q].copy_(key_states)                         # back: the new entries
        self.host_values[:n, :, at:at + q].copy_(value_states)
        self.rows, self.length = n, at + q
        size = key_states.element_size()
        self.moved["h2d_bytes"] += (old_k.numel() + old_v.numel()) * size
        self.moved["d2h_bytes"] += (key_states.numel() + value_states.numel()) * size
        self.moved["crossings"] += 2
        return torch.cat([old_k, key_states], dim=-2), torch.cat([old_v, value_states], dim=-2)

    def get_seq_length(self) -> int:
        return self.length

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Rows ``beam_idx`` of the host buffer, in place (replicated or dropped rows)."""
        if not self.length:
            return
        idx, at = beam_idx.cpu(), self.length
        if len(idx) > self.capacity[0]:
            raise ValueError(f"the host KV cache holds {self.capacity[0]} rows; asked for {len(idx)}")
        self.host_keys[:len(idx), :, :at] = self.host_keys[idx, :, :at]    # (the gather is a copy first)
        self.host_values[:len(idx), :, :at] = self.host_values[idx, :, :at]
        self.rows = len(idx)

    def reset(self) -> None:
        self.rows = self.length = 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("the host KV cache does not crop (streamed decoding never asks it to)")


class HostKVCache(DynamicCache):
    """A ``DynamicCache`` of the model's config whose full-attention layers keep their K/V in host
    RAM for ``rows`` x ``tokens`` at most (see the module); :attr:`moved` counts the link's bytes."""

    def __init__(self, config, rows: int, tokens: int):
        super().__init__(config=config)
        self.moved: Dict[str, int] = {"h2d_bytes": 0, "d2h_bytes": 0, "crossings": 0}
        self.layers = [HostKVLayer(rows, tokens, self.moved) if type(layer) is DynamicLayer else layer
                       for layer in self.layers]
        self.host_layers = sum(isinstance(layer, HostKVLayer) for layer in self.layers)


__all__ = ["HostKVCache", "HostKVLayer"]
