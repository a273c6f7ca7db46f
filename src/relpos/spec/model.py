"""The reference transformer's config, framework-neutral: its size, scheme and checks.

:class:`relpos.TransformerConfig` (PyTorch) extends it with the attention backend's name check;
the Keras :class:`relpos.keras.Transformer` validates its arguments with it directly.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from .base import (
    ABSOLUTE_SCHEMES,
    check_bool,
    check_config_keys,
    check_dropout,
    check_head_groups,
    check_heads,
    check_int,
    config_from_dict,
)

__all__ = ["ModelConfig"]


@dataclass(frozen=True)
class ModelConfig:
    """Size and scheme of a transformer; round-trips through ``to_dict``/``from_dict``.

    Args:
        vocab_size: number of token ids.
        d_model, num_heads, num_layers: width, heads, depth.
        d_ff: MLP hidden width (default ``4·d_model``).
        dropout: dropout on residual branches and attention probabilities, in ``[0, 1)``.
        causal: decoder-only (True) or encoder (False); a bool.
        scheme: the positional scheme, as a dict ``{"name": ..., **fields}`` (or a bare name).
        backend: attention backend (default ``"auto"``; PyTorch only, see
            :class:`~relpos.attention.MultiheadAttention`).
        num_kv_heads: key/value heads for grouped-query attention (default ``num_heads``).
        layer_schemes: one attention scheme per layer (``num_layers`` names or dicts), e.g. RoPE
            in three layers and NoPE in the fourth; replaces ``scheme`` inside attention (an
            absolute ``scheme`` still acts at the input).
        share_relative: one scheme module, tables included, shared by every layer (T5's
            choice); every layer must then have the same scheme.
    """

    vocab_size: int
    d_model: int = 256
    num_heads: int = 8
    num_layers: int = 4
    d_ff: int | None = None
    dropout: float = 0.1
    causal: bool = True
    scheme: dict[str, Any] = field(default_factory=lambda: {"name": "nope"})
    backend: str = "auto"
    num_kv_heads: int | None = None  # new fields go last: the order is positional API
    layer_schemes: list[dict[str, Any]] | None = None
    share_relative: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "num_layers"):
            check_int(name, getattr(self, name), minimum=1)
        check_heads(self.d_model, self.num_heads)
        if self.num_kv_heads is not None:
            check_head_groups(self.num_heads, self.num_kv_heads)
        if self.d_ff is not None:
            check_int("d_ff", self.d_ff, minimum=1)
        check_dropout(self.dropout)
        check_bool("causal", self.causal)
        if not isinstance(self.backend, str):
            raise TypeError(f"backend must be a str, got {type(self.backend).__name__}")
        scheme = {"name": self.scheme} if isinstance(self.scheme, str) else self.scheme
        # Validate now (unknown names or keys fail here, not deep inside the model).
        object.__setattr__(self, "scheme", config_from_dict(scheme).to_dict())
        if self.layer_schemes is not None:
            if not isinstance(self.layer_schemes, list | tuple) or len(self.layer_schemes) != (
                self.num_layers
            ):
                raise ValueError(
                    f"layer_schemes must be a list of num_layers={self.num_layers} schemes, "
                    f"got {self.layer_schemes!r}"
                )
            specs = [
                config_from_dict({"name": s} if isinstance(s, str) else s).to_dict()
                for s in self.layer_schemes
            ]
            absolute = [s["name"] for s in specs if s["name"] in ABSOLUTE_SCHEMES]
            if absolute:
                raise ValueError(
                    f"layer_schemes are attention schemes; {absolute} act at the input: "
                    "give them as scheme="
                )
            object.__setattr__(self, "layer_schemes", specs)
        check_bool("share_relative", self.share_relative)
        if (
            self.share_relative
            and self.layer_schemes is not None
            and any(s != self.layer_schemes[0] for s in self.layer_schemes)
        ):
            raise ValueError("share_relative needs the same scheme in every layer")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        check_config_keys("model config", cls, data)
        return cls(**data)
