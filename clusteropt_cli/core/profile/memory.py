"""Peak memory without an allocator: the CPU definition shared with `copt advise` (see docs/profile.md).

On CPU a training step's `peak_mem_bytes` is
    model states (params + grads + optimizer states, bytes of the real tensors)
  + the peak bytes of tensors saved for backward, live at the same time (unique storages, parameters excluded),
    tracked with `torch.autograd.graph.saved_tensors_hooks` through forward *and* backward (so the recomputation
    of activation checkpointing is counted while it is alive)
  + the logits and loss the forward returns (when not already counted as saved).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any


class _Saved:
    """What autograd stores instead of the tensor: when autograd drops it, its storage stops counting."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: Any):
        self.tensor = tensor


class SavedTensorTracker:
    """Counts the bytes of live saved-for-backward storages; `peak` is the most at any moment.

    Use `with tracker.hooks():` around forward and backward.
    """

    def __init__(self, exclude_ptrs: Iterable[int] = ()):
        self.exclude = set(exclude_ptrs)
        self.live: dict[int, list[int]] = {}  # storage data_ptr -> [holders, nbytes]
        self.current = 0
        self.peak = 0

    def _pack(self, tensor: Any) -> Any:
        storage = tensor.untyped_storage()
        ptr = storage.data_ptr()
        nbytes = storage.nbytes()
        if ptr in self.exclude or nbytes == 0 or tensor.device.type == "meta":
            return tensor
        entry = self.live.get(ptr)
        if entry is None:
            self.live[ptr] = [1, nbytes]
            self.current += nbytes
            self.peak = max(self.peak, self.current)
        else:
            entry[0] += 1
        holder = _Saved(tensor)
        weakref.finalize(holder, self._release, ptr)
        return holder

    def _release(self, ptr: int) -> None:
        entry = self.live.get(ptr)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            self.current -= entry[1]
            del self.live[ptr]

    @staticmethod
    def _unpack(packed: Any) -> Any:
        return packed.tensor if isinstance(packed, _Saved) else packed

    def hooks(self):
        import torch

        return torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)


def tensor_bytes(tensors: Iterable[Any]) -> int:
    """Bytes of the unique storages behind some tensors."""
    seen: dict[int, int] = {}
    for t in tensors:
        if t is None:
            continue
        storage = t.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def optimizer_state_bytes(optimizer: Any) -> int:
    """Bytes of every tensor the optimizer keeps (exp_avg, exp_avg_sq, momentum, step counters...)."""
    import torch

    return tensor_bytes(v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor))


def cache_bytes(past_key_values: Any) -> int:
    """Bytes of the tensors inside a KV cache object (DynamicCache layers or legacy tuples)."""
    import torch

    found: list[Any] = []

    def walk(obj: Any, depth: int = 0) -> None:
        if depth > 4 or obj is None:
            return
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                walk(item, depth + 1)
        elif hasattr(obj, "layers"):
            walk(list(obj.layers), depth + 1)
        elif hasattr(obj, "keys") and hasattr(obj, "values") and not isinstance(obj, dict):
            walk([obj.keys, obj.values], depth + 1)

    walk(past_key_values)
    return tensor_bytes(found)
