"""pytest configuration: hypothesis profile (deterministic, no deadline: oracles are slow)."""

from hypothesis import settings

settings.register_profile("default", deadline=None, max_examples=15, derandomize=True)
settings.register_profile("thorough", deadline=None, max_examples=200)
settings.load_profile("default")
