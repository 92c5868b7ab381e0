"""The KV cache of the HF engine's continuous batch: one preallocated buffer per layer that decode steps write in place.

transformers' DynamicLayer appends by `torch.cat` of the whole cache, an O(B x S) copy per decode step and layer,
which made a wide continuous batch cost more per step than a narrow one. `GrowingLayer` keeps keys / values as views
of a buffer [B, heads, capacity, head_dim] with spare room: a step writes its column in place, and the buffer is
reallocated only when full, when rows join (`merged`: every part right-aligned to one width, padding on the left)
or when rows leave (`batch_select_indices`, `drop_left`). Used by rsearch_verl/rollout/engines/hf.py:

    past.layers = [GrowingLayer.merged([layer], width) for layer in past.layers]   # after a prefill
    past.layers[i] = GrowingLayer.merged([old, new], width)                        # a join

Hybrid models (Qwen3.5 / 3.6: Gated DeltaNet layers beside full attention) also have linear-attention layers, whose
cache is a fixed-size recurrent state [B, heads, d_k, d_v] and conv state [B, channels, kernel] per row, with no
sequence axis. transformers' `LinearAttentionLayer` cannot drop rows (no `batch_select_indices`), so `RecurrentLayer`
adds that and joins (row concatenation: the states are per row, nothing to align). `growing(layer, width)` is the
conversion for any layer after a prefill; layers of other kinds (sliding window, ...) stay as they are.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer, LinearAttentionLayer


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose keys / values are views of a buffer [B, heads, capacity, head_dim] with room to grow."""

    def __init__(self, kbuf: torch.Tensor, vbuf: torch.Tensor, length: int):
        super().__init__()
        self.is_initialized = True
        self.dtype, self.device = kbuf.dtype, kbuf.device
        self._kbuf, self._vbuf, self.length = kbuf, vbuf, length
        self._view()

    @classmethod
    def merged(cls, parts: list[DynamicLayer], width: int) -> GrowingLayer:
        """One layer holding `parts` stacked along the batch, each right-aligned to `width` columns."""
        rows = sum(p.keys.shape[0] for p in parts)
        _, h, _, d = parts[0].keys.shape
        kbuf = parts[0].keys.new_zeros((rows, h, width + spare(width), d))
        vbuf = torch.zeros_like(kbuf)
        at = 0
        for p in parts:
            n, s = p.keys.shape[0], p.keys.shape[2]
            kbuf[at : at + n, :, width - s : width] = p.keys
            vbuf[at : at + n, :, width - s : width] = p.values
            at += n
        return cls(kbuf, vbuf, width)

    def _view(self) -> None:
        self.keys, self.values = self._kbuf[:, :, : self.length], self._vbuf[:, :, : self.length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        end = self.length + key_states.shape[2]
        if end > self._kbuf.shape[2]:  # full: reallocate with room (amortised; a step never copies the cache)
            self._kbuf, self._vbuf = (self._grown(buf, end + spare(end)) for buf in (self._kbuf, self._vbuf))
        self._kbuf[:, :, self.length : end] = key_states
        self._vbuf[:, :, self.length : end] = value_states
        self.length = end
        self._view()
        return self.keys, self.values

    def _grown(self, buf: torch.Tensor, capacity: int) -> torch.Tensor:
        out = buf.new_zeros((*buf.shape[:2], capacity, buf.shape[3]))
        out[:, :, : self.length] = buf[:, :, : self.length]
        return out

    def get_seq_length(self) -> int:
        return self.length

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._kbuf, self._vbuf = self._kbuf[indices], self._vbuf[indices]
        self._view()

    def drop_left(self, n: int) -> None:
        """Forget the first `n` columns (padding in every live row)."""
        self._kbuf, self._vbuf = self._kbuf[:, :, n:], self._vbuf[:, :, n:]
        self.length -= n
        self._view()


class RecurrentLayer(LinearAttentionLayer):
    """A linear-attention layer's cache (conv and recurrent state per row) that rows can leave and join."""

    @classmethod
    def merged(cls, parts: list[LinearAttentionLayer]) -> RecurrentLayer:
        """One layer holding `parts`' rows in order (each part already past its prefill)."""
        layer = cls()
        layer.conv_states = torch.cat([p.conv_states for p in parts])
        layer.recurrent_states = torch.cat([p.recurrent_states for p in parts])
        layer.dtype, layer.device = layer.conv_states.dtype, layer.conv_states.device
        layer.max_batch_size, layer.conv_kernel_size = layer.conv_states.shape[0], layer.conv_states.shape[-1]
        layer.is_conv_states_initialized = layer.is_recurrent_states_initialized = True
        layer.has_previous_state = True
        return layer

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self.conv_states, self.recurrent_states = self.conv_states[indices], self.recurrent_states[indices]
        self.max_batch_size = self.conv_states.shape[0]

    def drop_left(self, n: int) -> None:
        """Nothing to drop: a recurrent state has no columns."""


def growing(layer, width: int):
    """The continuous batch's version of a layer just past its prefill (`width` columns): attention keys / values into
    a `GrowingLayer`, a linear-attention state into a `RecurrentLayer`; other kinds unchanged (not joinable)."""
    if type(layer) is DynamicLayer:
        return GrowingLayer.merged([layer], width)
    if type(layer) is LinearAttentionLayer and layer.is_conv_states_initialized:
        return RecurrentLayer.merged([layer])
    return layer


def joinable(layers) -> bool:
    """Whether rows can join a batch with these cache layers (every one a GrowingLayer or a RecurrentLayer)."""
    return all(isinstance(layer, (GrowingLayer, RecurrentLayer)) for layer in layers)


def merged(parts: list, width: int):
    """One layer holding the rows of `parts` (the same layer of two batches), attention right-aligned to `width`."""
    if isinstance(parts[0], RecurrentLayer):
        return RecurrentLayer.merged(parts)
    return GrowingLayer.merged(parts, width)


def spare(width: int) -> int:
    return max(64, width // 2)


def left_pad(t: torch.Tensor, width: int, dim: int) -> torch.Tensor:
    extra = width - t.shape[dim]
    if extra <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = extra
    return torch.cat([t.new_zeros(shape), t], dim=dim)
