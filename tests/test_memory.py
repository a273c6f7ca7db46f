"""Transformer-XL's segment-level recurrence (``Transformer.new_memory``): segments fed one after
another attend to a stop-gradient memory of the last ``mem_len`` tokens, at continuing positions."""

import pytest
import torch

import relpos
from relpos import Positions, Transformer, TransformerConfig
from tests.helpers import randomize_parameters

SPECS = [
    {"name": "transformer_xl", "max_distance": 8},
    "rope",
    {"name": "t5", "num_buckets": 8},
    "forgetting",  # the cache carries each token's cumulative forget gates
]


def model(spec, num_layers: int = 2) -> Transformer:
    torch.manual_seed(0)
    cfg = TransformerConfig(
        vocab_size=11, d_model=16, num_heads=2, num_layers=num_layers, dropout=0.0, causal=True,
        scheme=spec,
    )  # fmt: skip
    m = Transformer(cfg).eval()
    randomize_parameters(m)
    return m


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_segments_with_a_covering_memory_equal_one_forward(spec):
    m = model(spec)
    tokens = torch.randint(0, 11, (2, 15), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = m(tokens)
        memory = m.new_memory(mem_len=32)
        parts = [m(tokens[:, t : t + 5], cache=memory) for t in range(0, 15, 5)]
    torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("spec", SPECS, ids=str)
def test_a_short_memory_is_a_sliding_window(spec):
    """One layer, memory of 4: the second segment sees the last 4 tokens of the first, at their
    positions, exactly as one forward over that window does."""
    m = model(spec, num_layers=1)
    tokens = torch.randint(0, 11, (2, 14), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        memory = m.new_memory(mem_len=4)
        m(tokens[:, :8], cache=memory)
        assert len(memory[0]) == 4 and memory[0].positions.pos[0].tolist() == [4, 5, 6, 7]
        second = m(tokens[:, 8:], cache=memory)
        window = m(tokens[:, 4:], Positions.from_length(10, offset=4))[:, 4:]
    torch.testing.assert_close(second, window, atol=1e-5, rtol=1e-5)


def test_the_memory_carries_no_gradient():
    """Each segment's loss backpropagates into its own segment only: the second backward would
    fail ("backward through the graph a second time") if the memory kept the first one's graph."""
    m = model(SPECS[0]).train()
    tokens = torch.randint(0, 11, (2, 10))
    memory = m.new_memory(mem_len=16)
    m(tokens[:, :5], cache=memory).square().mean().backward()
    assert not any(c.k.requires_grad or c.v.requires_grad for c in memory)
    m(tokens[:, 5:], cache=memory).square().mean().backward()


def test_bad_memory_arguments():
    with pytest.raises(ValueError, match="max_len must be >= 0, got -1"):
        relpos.KVCache(max_len=-1)
    with pytest.raises(TypeError, match="max_len must be an int or None"):
        relpos.KVCache(max_len=2.5)
