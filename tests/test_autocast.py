"""``torch.autocast`` reaches the projections, never relpos's positions or attention.

Under autocast a model's projections give bfloat16 ``q, k, v``; relpos must then compute exactly
what it computes for bfloat16 inputs without autocast (float32 inside: positions, angles, biases,
softmax). Autocast would otherwise run relpos's float32 matmuls in bfloat16: FIRE's MLP gave
biases 80 % off, and the tiles' relative scatter and FIRE's kernel raised a dtype error.
"""

from __future__ import annotations

import random

import pytest
import torch

import relpos
from relpos import Positions
from relpos.attention.backends import BACKENDS
from relpos.models import Transformer, TransformerConfig
from tests.helpers import (
    DEVICES,
    SCHEME_SPECS,
    contextual,
    has_value_term,
    make_layout,
    randomize_parameters,
    skip_if_refused_deterministic,
    spec_id,
    tiles_refuse,
)

#: every scheme a backend runs directly (FoX's gates come from the layer input: the model test)
DIRECT = [s for s in SCHEME_SPECS if not contextual(s)]
pytestmark = pytest.mark.usefixtures("one_thread")  # tiny shapes: threads only add overhead
REFUSALS = {"sdpa": has_value_term, "chunked": tiles_refuse, "flex": tiles_refuse}


def _runs(backend: str, spec: dict) -> bool:
    refuses = REFUSALS.get(backend)
    return not (refuses and refuses(spec)) and not (backend == "flex" and has_value_term(spec))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["left-pad", "packed", "cached"])
@pytest.mark.parametrize("spec", DIRECT, ids=spec_id)
@pytest.mark.parametrize("backend", sorted(set(BACKENDS) - {"flex", "fused"}))  # fused: tests/fused
@pytest.mark.matrix
def test_a_backend_computes_the_same_under_autocast(backend, spec, layout, device, deterministic):
    """Outputs and every gradient bit for bit. A ``backward`` inside the autocast block runs too
    (torch advises against it: its own backward matmuls then run in bfloat16, so only finite).
    On CUDA in deterministic mode: a gradient summed by atomic adds (a gather's backward) differs
    from run to run in its last bits, autocast or not."""
    if not _runs(backend, spec):
        pytest.skip(f"{backend} refuses this scheme")
    if device == "cuda":
        deterministic(True)
    rng = random.Random(f"{spec_id(spec)}{layout}")
    torch.manual_seed(rng.randrange(1 << 30))
    b, h, d, n = 2, 2, 8, 40
    scheme = relpos.make_scheme(spec, d_model=h * d, num_heads=h, causal=True)
    randomize_parameters(scheme)
    scheme.to(device)
    qp, kp = (p.to(device) for p in make_layout(layout, rng, b, n))
    half = {"dtype": torch.bfloat16, "device": device}
    q = torch.randn(b, h, len(qp), d, **half, requires_grad=True)
    k = torch.randn(b, h, n, d, **half, requires_grad=True)
    v = torch.randn(b, h, n, d, **half, requires_grad=True)
    inputs = [q, k, v, *scheme.parameters()]
    grad_out = torch.randn(b, h, len(qp), d, **half)
    results = []
    for on, backward_inside in ((False, False), (True, False), (True, True)):
        try:
            with torch.autocast(device, torch.bfloat16, enabled=on):
                qr, kr = scheme.rotate(q, k, qp, kp)
                out = BACKENDS[backend](qr, kr, v, scheme, qp, kp, causal=True)
                if backward_inside:
                    grads = torch.autograd.grad(out, inputs, grad_out, allow_unused=True)
            if not backward_inside:
                grads = torch.autograd.grad(out, inputs, grad_out, allow_unused=True)
        except RuntimeError as e:  # an op PyTorch has no deterministic CUDA kernel for
            skip_if_refused_deterministic(e, f"not deterministic on {device}")
        results.append((out, grads))
    (out, grads), (out_ac, grads_ac), (_, grads_in) = results
    assert out_ac.dtype == torch.bfloat16
    assert torch.equal(out_ac, out)
    for i, (g, g_ac, g_in) in enumerate(zip(grads, grads_ac, grads_in, strict=True)):
        assert (g is None) == (g_ac is None) == (g_in is None), f"gradient {i}"
        if g is not None:
            assert torch.equal(g_ac, g), f"gradient {i}"
            assert torch.isfinite(g_in).all(), f"gradient {i}, backward inside"


def _model_case(spec: dict, where: str) -> tuple[Transformer, torch.Tensor, Positions]:
    torch.manual_seed(0)
    cfg = TransformerConfig(
        vocab_size=11, d_model=32, num_heads=2, num_layers=1, dropout=0.0, scheme=spec
    )
    model = Transformer(cfg)
    randomize_parameters(model)
    tokens = torch.randint(0, 11, (2, 24))
    if where == "far":  # angles and distances of positions in the thousands
        return model, tokens, Positions.from_length(24, offset=3000)
    mask = torch.ones(2, 24, dtype=torch.bool)
    mask[0, :5] = False
    return model, tokens, Positions.from_padding_mask(mask)


@pytest.mark.parametrize("where", ["padded", "far"])
@pytest.mark.parametrize("spec", SCHEME_SPECS, ids=spec_id)
@pytest.mark.matrix
def test_a_model_under_autocast_stays_near_float32(spec, where):
    """Logits and the gradient of the embedding within bfloat16's reach of float32."""
    if where == "far" and spec["name"] == "learned":
        pytest.skip("the learned table ends at max_len")
    model, tokens, positions = _model_case(spec, where)
    results = []
    for on in (False, True):
        model.zero_grad()
        with torch.autocast("cpu", torch.bfloat16, enabled=on):
            logits = model(tokens, positions).float()
            logits[positions.valid.expand(2, -1)].square().mean().backward()
        valid = positions.valid.expand(2, -1)
        results.append((logits[valid], model.embed.tokens.weight.grad.clone()))
    (ref, g_ref), (out, g) = results
    scale = ref.abs().max()
    assert (out - ref).abs().max() <= 0.05 * scale, "logits"
    assert (g - g_ref).abs().max() <= 0.1 * g_ref.abs().max(), "gradient"


def test_a_device_without_autocast_runs_as_before():
    """``meta`` has no autocast: shape inference through a layer still works."""
    attn = relpos.MultiheadAttention(16, 2, "alibi", causal=True).to("meta")
    assert attn(torch.randn(2, 5, 16, device="meta")).shape == (2, 5, 16)
