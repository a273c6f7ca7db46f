import pytest

import relpos
from tests.helpers import SCHEME_SPECS


def test_every_registered_scheme_is_covered_by_the_specs():
    assert {s["name"] for s in SCHEME_SPECS} == set(relpos.SCHEMES)


def test_a_scheme_refuses_another_schemes_config():
    """``ALiBi`` and ``LearnedALiBi`` share their config's fields, yet neither takes the other's
    config: every registered scheme refuses every other scheme's (a TypeError naming both)."""
    for name, cls in relpos.SCHEMES.items():
        for other, other_cls in relpos.SCHEMES.items():
            if other == name:
                continue
            with pytest.raises(TypeError, match=f"needs a {cls.config_class.__name__}"):
                cls(other_cls.config_class(), d_model=16, num_heads=2, causal=True)
