"""What the attention backends keep between calls: one bounded cache, one eviction rule.

Everything kept is a function of geometry (lengths, band, block sizes, dtype, device, a scheme's
config), never of values, so every call of one shape shares it. :class:`BoundedCache` holds it:
least recently used out first once the items' total cost passes the budget; an item that alone
costs more is not kept. :class:`Scratch` gives each thread reusable buffers for temporaries under
the same rule.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable
from typing import Any

import torch
from torch import Tensor

__all__ = ["BoundedCache", "Scratch", "tensor_bytes"]


def tensor_bytes(value: Any) -> int:
    """Bytes of a tensor, or of the tensors in a tuple or list."""
    if isinstance(value, Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, tuple | list):
        return sum(tensor_bytes(v) for v in value)
    return 0


class BoundedCache:
    """A thread-safe LRU map whose items' total ``cost`` stays within ``budget``.

    Args:
        budget: the most total cost kept (bytes by default).
        cost: an item's cost; :func:`tensor_bytes` by default, ``lambda v: 1`` counts items.
    """

    def __init__(self, budget: int, cost: Callable[[Any], int] = tensor_bytes) -> None:
        self.budget, self.cost = budget, cost
        self._items: OrderedDict[Hashable, tuple[Any, int]] = OrderedDict()
        self._total = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    @property
    def total(self) -> int:
        """The total cost kept now."""
        return self._total

    def items(self) -> list[tuple[Hashable, Any]]:
        """The kept ``(key, value)`` pairs, least recently used first."""
        with self._lock:
            return [(k, v) for k, (v, _) in self._items.items()]

    def get(self, key: Hashable) -> Any | None:
        with self._lock:
            hit = self._items.get(key)
            if hit is None:
                return None
            self._items.move_to_end(key)
            return hit[0]

    def put(self, key: Hashable, value: Any) -> None:
        cost = self.cost(value)
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._total -= old[1]
            if cost > self.budget:
                return
            self._items[key] = (value, cost)
            self._total += cost
            while self._total > self.budget:
                _, (_, c) = self._items.popitem(last=False)
                self._total -= c

    def get_or_build(self, key: Hashable, build: Callable[[], Any]) -> Any:
        """The value of ``key``, built by ``build()`` (and kept) on a miss.

        Built outside inference mode, so a value cached during an inference call serves later
        calls with autograd too. Under ``torch.compile`` nothing is kept: the graph builds it.
        """
        if torch.compiler.is_compiling():  # the compiled graph computes it; a lock can't be traced
            return build()
        hit = self.get(key)
        if hit is None:
            with torch.inference_mode(False):
                hit = build()
            self.put(key, hit)
        return hit

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._total = 0


class Scratch(threading.local):
    """Per-thread buffers for an engine's temporaries, reused from call to call.

    With glibc's default allocator a temporary of a few MiB is a fresh ``mmap`` on every call, and
    its pages fault in again. A buffer is taken by name; nothing taken may outlive the call that
    takes it (no returned or saved tensor is a view of one), and a name is taken once per use.
    """

    def __init__(self, budget: int) -> None:
        self.buffers = BoundedCache(budget)

    def take(self, name: str, shape: tuple[int, ...], like: Tensor) -> Tensor:
        """An uninitialised ``shape`` tensor of ``like``'s dtype and device."""
        numel = math.prod(shape)
        key = (name, like.dtype, like.device)
        buf = self.buffers.get(key)
        if buf is None or buf.numel() < numel:
            with torch.inference_mode(False):  # usable by later calls outside inference mode
                buf = torch.empty(numel, dtype=like.dtype, device=like.device)
            self.buffers.put(key, buf)
        return buf[:numel].view(shape)
