"""T5's relative position bias (Raffel et al., 2020, §2.1): config and its checks."""

from __future__ import annotations

from dataclasses import dataclass

from .base import SchemeConfig, check_heads_field, check_int, register_config

__all__ = ["T5Config"]


@register_config
@dataclass(frozen=True)
class T5Config(SchemeConfig):
    """Args:
    num_buckets: buckets shared by all distances (half per direction when bidirectional).
    max_distance: distance from which all pairs share the farthest bucket.
    heads: the heads that get the bias (indices), or None for every head; the others get 0.
    """

    name = "t5"
    num_buckets: int = 32
    max_distance: int = 128
    heads: tuple[int, ...] | None = None

    def validate(self) -> None:
        check_int("num_buckets", self.num_buckets, minimum=2)
        check_int("max_distance", self.max_distance, minimum=1)
        object.__setattr__(self, "heads", check_heads_field(self.heads))

    def validate_dims(self, *, num_heads: int, head_dim: int, causal: bool) -> None:
        """Bidirectional bucketing splits the buckets between the two directions, each with an
        exact bucket and a log-spaced one; the log buckets start after the exact ones, so
        ``max_distance`` must lie beyond them (else their scale is ``log(1) = 0``)."""
        super().validate_dims(num_heads=num_heads, head_dim=head_dim, causal=causal)
        if not causal and (self.num_buckets % 2 or self.num_buckets < 4):
            raise ValueError(
                "bidirectional T5 bias needs an even num_buckets >= 4 (each direction an exact "
                f"bucket and a log-spaced one), got {self.num_buckets}"
            )
        per_direction = self.num_buckets // (1 if causal else 2)
        if self.max_distance <= per_direction // 2:
            raise ValueError(
                f"max_distance ({self.max_distance}) must exceed the exact buckets per direction "
                f"({per_direction // 2})"
            )
