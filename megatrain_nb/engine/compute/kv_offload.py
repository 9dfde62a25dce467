"""The streamed decoder's KV caches: preallocated on the device (:class:`DeviceKVCache`), or in
host RAM (:class:`HostKVCache`), each layer's keys and values crossing to the device only while
that layer runs.

Example::

    cache = DeviceKVCache(model_config, rows=64, tokens=1088)   # or HostKVCache(...), same arguments
    model(input_ids=ids, cache=cache, use_cache=True)      # the model's own attention fills it
    cache.moved    # (HostKVCache) {"h2d_bytes", "d2h_bytes", "crossings"}: what crossed the link

**On the device** (:class:`DeviceKVLayer`): transformers' ``DynamicLayer`` concatenates each
layer's whole cache with the new token's entries at every pass, a copy of the cache per layer
per decoded token (quadratic in the completion's length, and growing with the rows). The
decoder knows its rows and tokens before it starts (the planner sized the cache from them), so
each full-attention layer holds one buffer of ``rows`` x heads x ``tokens`` x head size for its
keys and one for its values, allocated at its first update (the shapes and dtype the attention
gives), writes the new entries in place and hands the attention a view of the entries cached so
far (``[rows decoding, heads, length, head size]``, strided over the capacity's tokens): no
copy of the past per pass. ``reorder_cache`` (a group's prompt replicated, finished rows
dropped) gathers the kept rows to the buffer's front, once per change of the rows.

Both are a transformers ``DynamicCache`` built from the model's config (sliding-window and
linear-attention layers as transformers makes them, kept on the device) whose full-attention
layers (``DynamicLayer``) are replaced. **In host RAM** they are :class:`HostKVLayer`: a buffer in host RAM (pinned when the device
is a GPU) of ``tokens`` x ``rows`` x heads x head size for the keys and the values (tokens first,
so the entries cached so far are one contiguous block: one copy from pinned memory), allocated at
its first update with the shapes the attention gives. A layer's ``update`` (the model's attention
calls it once per pass, as the layer runs, and layer-major decoding runs each layer once per
decoded token) copies the layer's cached entries to the device (in), writes the new token's
entries into the buffer (back), and returns the two concatenated on the device: each layer
crosses the link twice per decoded token, counted in :attr:`HostKVCache.moved` (a CPU device
counts the same bytes, which on a GPU cross the link). On a GPU both copies are asynchronous, in
the compute stream's order (the next pass's copy in follows this one's copy back): the host
never waits for a layer, and an event after each layer's copies is what the host waits for
before it touches the buffer itself (``reorder_cache``) and what its pinned buffer's finalizer
waits for (``pinned.note_use``); the buffers are registered at their exact size
(``pinned.pinned_empty``, as the plan counts them). ``reorder_cache`` (shared prompts
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

from ..transport.pinned import note_use, pinned_empty


class DeviceKVLayer(DynamicLayer):
    """A full-attention layer's K/V in preallocated device buffers of ``rows`` x ``tokens`` (see the
    module): the new entries written in place, the attention handed views of those cached so far."""

    def __init__(self, rows: int, tokens: int):
        super().__init__()
        self.capacity = (int(rows), int(tokens))
        self.rows = self.length = 0
        self.rows_moved = 0   # rows gathered by reorder_cache (each layer, keys and values)
        self.buffers = None   # (keys, values): [rows, heads, tokens, head size] each

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        rows, tokens = self.capacity
        self.buffers = tuple(torch.empty((rows, s.shape[1], tokens, s.shape[3]), dtype=s.dtype, device=s.device)
                             for s in (key_states, value_states))
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """The layer's cached entries with the new ones, as views of the buffers (no copy of the past)."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, q, at = key_states.shape[0], key_states.shape[-2], self.length
        rows, tokens = self.capacity
        if n > rows or at + q > tokens:
            raise ValueError(f"the device KV cache holds {rows} rows x {tokens} tokens; the decoding reached "
                             f"{n} rows x {at + q} tokens")
        if at and n != self.rows:
            raise ValueError(f"the device KV cache holds {self.rows} rows; the model gave {n} (reorder_cache first)")
        for buf, new in zip(self.buffers, (key_states, value_states)):
            buf[:n, :, at:at + q].copy_(new)
        self.rows, self.length = n, at + q
        self.keys, self.values = (buf[:n, :, :at + q] for buf in self.buffers)
        return self.keys, self.values

    def get_seq_length(self) -> int:
        return self.length

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Rows ``beam_idx`` to the buffers' front (replicated or dropped rows): one gather each, of
        the rows from the first one that changes (a row kept where it is, and every row before it,
        is not copied: dropping finished rows moves only those after the first finished one)."""
        if not self.length:
            return
        if len(beam_idx) > self.capacity[0]:
            raise ValueError(f"the device KV cache holds {self.capacity[0]} rows; asked for {len(beam_idx)}")
        idx, at, m = beam_idx.to(self.device), self.length, len(beam_idx)
        n = min(m, self.rows)
        first = int((idx[:n] == torch.arange(n, device=idx.device)).cumprod(0).sum())   # rows already in place
        if first < m:
            for buf in self.buffers:   # (the gather is a copy first: the same buffer)
                buf[first:m, :, :at] = buf[:self.rows, :, :at].index_select(0, idx[first:])
        self.rows_moved += m - first
        self.rows = m
        self.keys, self.values = (buf[:m, :, :at] for buf in self.buffers)

    def reset(self) -> None:
        self.rows = self.length = 0
        self.keys = self.values = None

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("the device KV cache does not crop (streamed decoding never asks it to)")

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("the device KV cache replicates rows by reorder_cache")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        raise NotImplementedError("the device KV cache selects rows by reorder_cache")


class HostKVLayer(DynamicLayer):
    """A full-attention layer's K/V in a host buffer (see the module). The buffer is laid out
    tokens-first for the rows decoding (``[tokens, rows, heads, head size]``, compacted when rows
    leave): the entries cached so far are one contiguous block, one copy to the device."""

    def __init__(self, rows: int, tokens: int, moved: Dict[str, int]):
        super().__init__()
        self.capacity, self.moved = (int(rows), int(tokens)), moved
        self.rows = self.length = 0
        self.host_keys = self.host_values = None   # flat buffers of capacity rows x tokens
        self.written = None   # (a GPU) the event after the last copies to and from the buffers

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        self.device = key_states.device
        pin = key_states.device.type == "cuda"
        rows, tokens = self.capacity
        if key_states.shape[0] > rows:
            raise ValueError(f"the host KV cache holds {rows} rows; the model gave {key_states.shape[0]}")
        self.shapes = (tuple(key_states.shape[1:2] + key_states.shape[3:]),
                       tuple(value_states.shape[1:2] + value_states.shape[3:]))   # (heads, head size) each
        self.host_keys, self.host_values = (
            pinned_empty(rows * tokens * h * d, key_states.dtype) if pin else
            torch.empty(rows * tokens * h * d, dtype=key_states.dtype) for h, d in self.shapes)
        self.is_initialized = True

    def held(self, rows: int):
        """The keys' and values' buffers as ``[tokens, rows, heads, head size]`` for ``rows`` rows."""
        t = self.capacity[1]
        return tuple(flat[:t * rows * h * d].view(t, rows, h, d)
                     for flat, (h, d) in zip((self.host_keys, self.host_values), self.shapes))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """The layer's cached entries and the new ones, on the device; the new ones kept in host RAM."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n, q, at = key_states.shape[0], key_states.shape[-2], self.length
        if at + q > self.capacity[1]:
            raise ValueError(f"the host KV cache holds {self.capacity[1]} tokens a row; the decoding reached {at + q}")
        if at and n != self.rows:
            raise ValueError(f"the host KV cache holds {self.rows} rows; the model gave {n} (reorder_cache first)")
        out, cuda = [], self.device.type == "cuda"
        for buf, new in zip(self.held(n), (key_states, value_states)):
            old = buf[:at].to(self.device, non_blocking=True).permute(1, 2, 0, 3)   # in (pinned: asynchronous)
            buf[at:at + q].copy_(new.permute(2, 0, 1, 3), non_blocking=cuda)          # back: the new entries
            self.moved["h2d_bytes"] += old.numel() * old.element_size()
            self.moved["d2h_bytes"] += new.numel() * new.element_size()
            out.append(torch.cat([old, new], dim=-2))
        if cuda:   # what the host waits for before touching the buffers, and their finalizer too
            self.written = torch.cuda.Event()
            self.written.record()
            for flat in (self.host_keys, self.host_values):
                note_use(flat, self.written, "kv")
        self.rows, self.length = n, at + q
        self.moved["crossings"] += 2
        return out[0], out[1]

    def get_seq_length(self) -> int:
        return self.length

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        """Rows ``beam_idx`` of the host buffer, in place (replicated or dropped rows)."""
        if not self.length:
            return
        idx, at = beam_idx.cpu(), self.length
        if len(idx) > self.capacity[0]:
            raise ValueError(f"the host KV cache holds {self.capacity[0]} rows; asked for {len(idx)}")
        if self.written is not None:   # the copies in and back under way, done before the host rewrites
            self.written.synchronize()
        for now, then in zip(self.held(self.rows), self.held(len(idx))):
            then[:at] = now[:at, idx]   # (the gather is a copy first: the two views share the buffer)
        self.rows = len(idx)

    def reset(self) -> None:
        self.rows = self.length = 0

    def crop(self, tokens_to_remove: int) -> None:
        raise NotImplementedError("the host KV cache does not crop (streamed decoding never asks it to)")


def full_attention_layers(cache: DynamicCache, make) -> int:
    """``cache``'s plain full-attention layers (``DynamicLayer``, not sliding or linear) replaced by
    ``make()``'s; how many."""
    full = [type(layer) is DynamicLayer for layer in cache.layers]
    cache.layers = [make() if f else layer for f, layer in zip(full, cache.layers)]
    return sum(full)


class DeviceKVCache(DynamicCache):
    """A ``DynamicCache`` of the model's config whose full-attention layers are preallocated for
    ``rows`` x ``tokens`` at most on the device (:class:`DeviceKVLayer`, see the module)."""

    def __init__(self, config, rows: int, tokens: int):
        super().__init__(config=config)
        self.device_layers = full_attention_layers(self, lambda: DeviceKVLayer(rows, tokens))


class HostKVCache(DynamicCache):
    """A ``DynamicCache`` of the model's config whose full-attention layers keep their K/V in host
    RAM for ``rows`` x ``tokens`` at most (see the module); :attr:`moved` counts the link's bytes."""

    def __init__(self, config, rows: int, tokens: int):
        super().__init__(config=config)
        self.moved: Dict[str, int] = {"h2d_bytes": 0, "d2h_bytes": 0, "crossings": 0}
        self.host_layers = full_attention_layers(self, lambda: HostKVLayer(rows, tokens, self.moved))


__all__ = ["DeviceKVCache", "DeviceKVLayer", "HostKVCache", "HostKVLayer"]
