"""Rotary position embedding (Su et al., 2021, "RoFormer", §3.4), its long-context scalings,
xPos and learned frequencies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from ..functional.rope import apply_rope, rope_angles
from ..functional.rope_scaling import (
    LENGTH_DEPENDENT,
    check_rope_scaling,
    scaled_rope_frequencies,
    sequence_rope_frequencies,
)
from ..functional.xpos import xpos_decay, xpos_max_position, xpos_scale
from ..positions import Positions, sequence_lengths
from .base import Scheme, SchemeConfig, check_int, check_positive_float, register

__all__ = ["Rotary", "RotaryConfig"]


@dataclass(frozen=True)
class RotaryConfig(SchemeConfig):
    """Args:
    theta: frequency base (10000 in the paper; 500000 in Llama 3).
    rotary_dim: how many leading features of each head rotate (even, ``<= head_dim``); ``None``
        rotates all of them. The rest pass through (partial rotary, as in GPT-NeoX).
    interleaved: pair ``(x[2k], x[2k+1])`` (the paper, GPT-J) instead of ``(x[k], x[k + r/2])``
        (half-split, GPT-NeoX and Llama).
    scaling: a long-context scaling as checkpoints ship it (a Hugging Face ``rope_scaling`` /
        ``rope_parameters`` dict, pasted as is): ``rope_type`` ``linear``, ``ntk``, ``yarn``,
        ``llama3``, ``dynamic`` or ``longrope`` and its keys
        (:mod:`relpos.functional.rope_scaling`). Stored normalised, as sorted ``(key, value)``
        pairs so the config stays hashable; ``to_dict`` gives a dict.
    xpos_scale_base: xPos (Sun et al., 2022): scale q and k so that their product decays as
        ``ζ_m^((n-m)/γ)`` with ``γ`` this value (512 in the paper); causal attention only.
    learned_freq: make the frequencies a trained parameter, initialised to the (scaled) ladder.
    """

    name = "rope"
    theta: float = 10000.0
    rotary_dim: int | None = None
    interleaved: bool = False
    scaling: Any = None
    xpos_scale_base: float | None = None
    learned_freq: bool = False

    @property
    def scaling_dict(self) -> dict[str, Any] | None:
        return None if self.scaling is None else dict(self.scaling)

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "scaling": self.scaling_dict}

    def validate(self) -> None:
        check_positive_float("theta", self.theta)
        if self.rotary_dim is not None:
            check_int("rotary_dim", self.rotary_dim, minimum=2)
            if self.rotary_dim % 2:
                raise ValueError(
                    f"rotary_dim must be even (features rotate in pairs), got {self.rotary_dim}"
                )
        if self.scaling is not None:
            given = dict(self.scaling) if isinstance(self.scaling, tuple) else self.scaling
            normal = check_rope_scaling(given, theta=self.theta)
            object.__setattr__(self, "scaling", tuple(sorted(normal.items())))
        if self.xpos_scale_base is not None:
            check_positive_float("xpos_scale_base", self.xpos_scale_base)
        if not isinstance(self.learned_freq, bool):
            raise TypeError(f"learned_freq must be a bool, got {self.learned_freq!r}")
        if self.learned_freq and self.length_dependent:
            raise ValueError(
                f"learned_freq cannot be combined with rope_type {self.scaling_dict['rope_type']!r}"
                " (its frequencies follow each sequence's length)"
            )

    @property
    def length_dependent(self) -> bool:
        """Whether the frequencies depend on each sequence's length (dynamic NTK, LongRoPE)."""
        return self.scaling is not None and self.scaling_dict["rope_type"] in LENGTH_DEPENDENT


@register
class Rotary(Scheme):
    """Rotates queries and keys by angles ``p·ω_m`` (``ω_m = θ^(-2m/r)``, or a long-context
    scaling of it) from each token's own position, so ``q_i·k_j`` depends on ``p_j - p_i`` only.

    * Static scalings (linear, NTK, YaRN, Llama 3) and plain RoPE rotate keys once, before they
      enter the KV cache. YaRN and LongRoPE also scale q and k by their attention factor (logits by
      its square), as their papers and Hugging Face do.
    * Dynamic NTK and LongRoPE choose frequencies from the length of each token's own sequence
      (:func:`~relpos.sequence_lengths`: its document in a packed row, everything seen so far when
      decoding), not from the batch's longest row. Keys then enter the cache unrotated and are
      rotated at every call with the frequencies of their sequence's current length
      (``rotates_cached_keys``), so cached keys and new queries always agree: decoding step ``t``
      equals the full forward over the first ``t`` tokens of that row.
    * xPos multiplies pair ``m`` of a query at ``n`` by ``ζ_m^(n/γ)`` and of a key at ``n'`` by
      ``ζ_m^(-n'/γ)``. The scales grow exponentially with the position, so a position beyond
      :func:`~relpos.functional.xpos.xpos_max_position` for the input dtype is a ``ValueError``
      (checked on the data: one device sync per call).
    """

    config_class = RotaryConfig
    hooks = frozenset({"rotate"})

    def __init__(self, config: RotaryConfig | None = None, **dims) -> None:
        super().__init__(config, **dims)
        c = self.config
        r = self.head_dim if c.rotary_dim is None else c.rotary_dim
        if r > self.head_dim or r % 2:
            raise ValueError(f"rotary_dim must be even and <= head_dim ({self.head_dim}), got {r}")
        if c.xpos_scale_base is not None and not self.causal:
            raise ValueError(
                "xPos needs causal attention: its scale ζ^((n-m)/γ) grows without bound for keys "
                "after the query"
            )
        self.rotary_dim = r
        self.rotates_cached_keys = c.length_dependent
        inv_freq, self.attention_factor = scaled_rope_frequencies(r, c.theta, c.scaling_dict)
        if c.learned_freq:
            self.inv_freq = nn.Parameter(inv_freq)
        else:
            self.register_buffer("inv_freq", inv_freq, persistent=False)
        if c.xpos_scale_base is not None:
            self.register_buffer("xpos_decay", xpos_decay(r), persistent=False)

    def _angles(self, positions: Positions, lengths: Tensor | None) -> Tensor:
        if lengths is None:
            return rope_angles(positions.pos, self.inv_freq)
        c = self.config
        inv = sequence_rope_frequencies(
            self.rotary_dim, c.theta, c.scaling_dict, lengths, dtype=self.inv_freq.dtype
        )
        return rope_angles(positions.pos, inv)

    def _xpos(self, positions: Positions, dtype: torch.dtype, *, key: bool) -> Tensor | None:
        base = self.config.xpos_scale_base
        if base is None:
            return None
        limit = xpos_max_position(dtype, base)
        if len(positions) and int(positions.pos.abs().max()) > limit:
            raise ValueError(
                f"xPos scales overflow {dtype} beyond position {limit} (xpos_scale_base={base}); "
                f"got position {int(positions.pos.abs().max())}: use float32 or bfloat16, or a "
                "larger xpos_scale_base"
            )
        return xpos_scale(positions.pos, self.xpos_decay, base, inverse=key)

    def rotate(
        self, q: Tensor, k: Tensor, q_positions: Positions, k_positions: Positions
    ) -> tuple[Tensor, Tensor]:
        il = self.config.interleaved
        if self.rotates_cached_keys:
            q_len, k_len = sequence_lengths(q_positions, k_positions)
        else:
            q_len = k_len = None
        q_scale = self._xpos(q_positions, q.dtype, key=False)
        k_scale = self._xpos(k_positions, k.dtype, key=True)
        q = apply_rope(q, self._angles(q_positions, q_len), interleaved=il, scale=q_scale)
        k = apply_rope(k, self._angles(k_positions, k_len), interleaved=il, scale=k_scale)
        if self.attention_factor != 1.0:
            q, k = q * self.attention_factor, k * self.attention_factor
        return q, k
