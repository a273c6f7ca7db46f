"""The Keras scheme registry takes each name once, as the PyTorch one does: a second class of a
registered name (a copy-pasted scheme file) is refused instead of replacing the first silently."""

import pytest

from relpos.keras.schemes import KERAS_SCHEMES, AttentionScheme, T5Scheme
from relpos.keras.schemes.base import register


def test_a_scheme_name_registers_once():
    class Twin(AttentionScheme):
        scheme_name = "t5"

    with pytest.raises(ValueError, match="'t5' is already registered to T5Scheme"):
        register(Twin)
    assert KERAS_SCHEMES["t5"] is T5Scheme
    assert register(T5Scheme) is T5Scheme  # registering the same class again is harmless


def test_a_scheme_needs_a_name():
    class Nameless(AttentionScheme):
        pass

    with pytest.raises(ValueError, match=r"Nameless\.scheme_name must define a name"):
        register(Nameless)
    assert "" not in KERAS_SCHEMES
