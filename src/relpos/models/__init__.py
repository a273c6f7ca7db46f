"""Reference models built from a config, using any registered scheme."""

from .transformer import Block, Transformer, TransformerConfig

__all__ = ["Block", "Transformer", "TransformerConfig"]
