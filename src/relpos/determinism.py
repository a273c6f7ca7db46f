"""What relpos does under ``torch.use_deterministic_algorithms(True)``: a backend whose backward
pass sums a gradient by atomic adds (an order that varies from run to run on a GPU) refuses, or
warns with ``warn_only``, as PyTorch does for its own such ops."""

from __future__ import annotations

import warnings

import torch

__all__ = ["alert_atomic_sums"]


def alert_atomic_sums(what: str, *, stacklevel: int = 3) -> None:
    """Raise (or warn, with ``warn_only``) in deterministic mode; nothing otherwise.

    Args:
        what: the backend and the sums it makes, the start of the message (e.g. "the flex
            backend's backward pass sums the positional term's gradient by atomic adds").
        stacklevel: the warning's frame, as :func:`warnings.warn` counts it from this function's
            caller (3: the caller of the caller's caller, the user's code for a backend).

    Raises:
        RuntimeError: in deterministic mode without ``warn_only``; its message says "not
            deterministic" and names the way out.
    """
    if not torch.are_deterministic_algorithms_enabled():
        return
    message = (
        f"{what}, which is not deterministic; use another backend (eager, chunked, sdpa) for "
        "this scheme, or torch.use_deterministic_algorithms(True, warn_only=True)"
    )
    if torch.is_deterministic_algorithms_warn_only_enabled():
        warnings.warn(message, UserWarning, stacklevel=stacklevel + 1)
    else:
        raise RuntimeError(message)
