"""transformers' KV cache objects, across the versions this package runs on: a cache built from per-layer keys and
values (with spare room for decoding), the keyword a model's forward takes it by, the cache a forward returns, and
its layers' tensors. :mod:`empo2.policy.prefix` lays shared heads out in these caches; generation and log-probs pass
them to the model.
"""

from __future__ import annotations

import functools
import inspect

import torch


def make_cache(model, layers: list[tuple[torch.Tensor, torch.Tensor]], room: int = 0):
    """A transformers DynamicCache holding the given per-layer (keys, values) [B, kv_heads, T, head_dim].

    With ``room`` > 0 (decoding, no grad) each layer keeps space for that many more tokens, so a decoding step
    writes its keys in place: a plain DynamicLayer concatenates, copying the whole cache at every step and layer,
    which was a third of a decoding step's time on a 2-core CPU.
    """
    from transformers import DynamicCache

    config = getattr(model, "config", None)
    if room <= 0 or _roomy_layer_class() is None:
        return DynamicCache(ddp_cache_data=layers, config=config)
    cache = DynamicCache(config=config)
    cache.layers = [_roomy_layer_class()(k, v, room) for k, v in layers]
    return cache


@functools.cache
def _roomy_layer_class():
    """The class of :func:`make_cache`'s layers (built on first use: transformers is imported lazily here, and
    versions before 4.56 have no cache layers, so they get ``None`` and a plain cache)."""
    try:
        from transformers.cache_utils import DynamicLayer
    except ImportError:
        return None

    class RoomyLayer(DynamicLayer):
        """A DynamicLayer whose keys and values are views into buffers with spare capacity; appends write in place
        (the buffers double when full)."""

        def __init__(self, keys: torch.Tensor, values: torch.Tensor, room: int):
            super().__init__()
            self.device, self.is_initialized, self.length = keys.device, True, 0
            self._keys = keys.new_empty(keys.shape[:2] + (keys.shape[2] + room, keys.shape[3]))
            self._values = values.new_empty(values.shape[:2] + (values.shape[2] + room, values.shape[3]))
            self.update(keys, values)

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            end = self.length + key_states.shape[-2]
            if end > self._keys.shape[-2]:  # out of room: double the buffers
                size = max(end, 2 * self._keys.shape[-2])
                self._keys, self._values = (
                    torch.cat([buf[:, :, :self.length], buf.new_empty(buf.shape[:2] + (size - self.length,
                                                                                      buf.shape[3]))], dim=-2)
                    for buf in (self._keys, self._values))
            self._keys[:, :, self.length:end] = key_states
            self._values[:, :, self.length:end] = value_states
            self.length = end
            self.keys, self.values = self._keys[:, :, :end], self._values[:, :, :end]
            return self.keys, self.values

    return RoomyLayer


def cache_kwargs(model, cache) -> dict:
    """``cache`` under the keyword ``model``'s forward takes it by: ``cache`` or, in transformers before the rename
    (5.19 and 4.x), ``past_key_values``. Read from the forward's signature because a model's ``**kwargs`` swallow a
    wrongly named cache without a word, and the forward then runs as if nothing were cached."""
    # a PEFT wrapper's own forward takes **kwargs only: read the wrapped model's
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return {_cache_keyword(type(base)): cache}


@functools.cache
def _cache_keyword(model_class) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def output_cache(out):
    """The KV cache a forward returned (``cache``, or ``past_key_values`` before the rename)."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def layer_kv(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (keys, values) [B, kv_heads, T, head_dim] of a cache, in either transformers layout."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return [(cache.key_cache[i], cache.value_cache[i]) for i in range(len(cache.key_cache))]  # transformers 4.x
