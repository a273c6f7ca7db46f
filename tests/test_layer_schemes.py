"""Per-layer schemes and one relative table shared by every layer (``TransformerConfig``)."""

import pytest
import torch

import relpos
from relpos import Transformer, TransformerConfig, checks
from tests import oracles
from tests.helpers import oracle_attention_layer, randomize_parameters

BASE = {"vocab_size": 12, "d_model": 32, "num_heads": 4, "num_layers": 4, "dropout": 0.0}


def test_per_layer_schemes_build_each_layer():
    cfg = TransformerConfig(**BASE, layer_schemes=["rope", "rope", "rope", "nope"])
    model = Transformer(cfg)
    kinds = [type(b.attn.scheme).__name__ for b in model.blocks]
    assert kinds == ["Rotary", "Rotary", "Rotary", "NoPE"]
    assert TransformerConfig.from_dict(cfg.to_dict()) == cfg
    again = Transformer(TransformerConfig.from_dict(cfg.to_dict()))
    again.load_state_dict(model.state_dict())  # round trip through a checkpoint's config


def test_per_layer_schemes_keep_per_row_positions():
    torch.manual_seed(0)
    cfg = TransformerConfig(
        **BASE,
        scheme="sinusoidal",
        layer_schemes=[
            "rope",
            {"name": "t5", "num_buckets": 8, "max_distance": 12},
            "alibi",
            "nope",
        ],
    )
    model = Transformer(cfg).eval()
    assert model.embed.scheme.config.name == "sinusoidal"  # the absolute scheme stays at the input
    tokens = torch.randint(0, 12, (3, 9))
    mask = torch.ones(3, 9, dtype=torch.bool)
    mask[1, :3] = False
    mask[2, 6:] = False
    with torch.no_grad():
        batch = model(tokens, padding_mask=mask)
        for r in range(3):
            alone = model(tokens[r : r + 1, mask[r]])
            torch.testing.assert_close(batch[r, mask[r]], alone[0], atol=1e-5, rtol=1e-5)


def test_shared_relative_table():
    t5 = {"name": "t5", "num_buckets": 8, "max_distance": 12}
    shared = Transformer(TransformerConfig(**BASE, scheme=t5, share_relative=True))
    separate = Transformer(TransformerConfig(**BASE, scheme=t5))
    schemes = {id(b.attn.scheme) for b in shared.blocks}
    assert len(schemes) == 1
    table = 8 * 4  # buckets × heads
    assert separate.num_parameters() - shared.num_parameters() == 3 * table
    # Every layer's use of the table reaches its gradient.
    tokens = torch.randint(0, 12, (2, 7))
    shared(tokens).sum().backward()
    grad_all = shared.blocks[0].attn.scheme.table.grad.clone()
    shared.zero_grad()
    for b in shared.blocks[1:]:  # cut the table out of layers 1..3: less gradient reaches it
        b.attn.scheme = relpos.make_scheme(t5, d_model=32, num_heads=4, causal=True)
    shared(tokens).sum().backward()
    assert not torch.allclose(grad_all, shared.blocks[0].attn.scheme.table.grad)
    # state_dict round trip keeps the sharing.
    again = Transformer(TransformerConfig(**BASE, scheme=t5, share_relative=True))
    again.load_state_dict(
        Transformer(TransformerConfig(**BASE, scheme=t5, share_relative=True)).state_dict()
    )
    assert again.blocks[0].attn.scheme is again.blocks[3].attn.scheme


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"layer_schemes": ["rope"]}, "layer_schemes must be a list of num_layers=4"),
        ({"layer_schemes": ["rope", "rope", "rope", "learned"]}, "act at the input"),
        ({"layer_schemes": ["rope", "rope", "rope", "bogus"]}, "unknown scheme 'bogus'"),
        (
            {"layer_schemes": ["rope", "rope", "rope", "nope"], "share_relative": True},
            "same scheme in every layer",
        ),
    ],
)
def test_bad_layer_schemes(kw, match):
    with pytest.raises(ValueError, match=match):
        TransformerConfig(**BASE, **kw)


@pytest.mark.parametrize("share", [False, True])
def test_mixed_and_shared_models_pass_the_parity_checks(share):
    torch.manual_seed(1)
    t5 = {"name": "t5", "num_buckets": 8, "max_distance": 12}
    layers = [t5] * 4 if share else ["rope", t5, "alibi", "nope"]
    model = Transformer(TransformerConfig(**BASE, layer_schemes=layers, share_relative=share))
    model.eval()
    docs = [torch.randint(1, 12, (n,)) for n in (5, 8, 3)]
    assert checks.padded_gap(model, docs, side="left") < 1e-5
    assert checks.packed_gap(model, [docs[:2], docs[2:]]) < 1e-5
    assert checks.cached_gap(model, torch.randint(1, 12, (2, 9)), chunk=2) < 1e-5
    assert checks.left_padded_decoding_gap(model, docs, torch.randint(1, 12, (3, 3))) < 1e-5


def test_relative_attention_with_a_timing_signal_is_the_sum_of_its_parts():
    """The paper's "relative + timing" model (``configs/jsb-music-timing.json``): a sinusoidal
    ``scheme`` at the input and the Music Transformer's relative attention in every layer equals
    the model written out from the two schemes' loop oracles (token embedding · √d + the
    sinusoid at each token's own position, then each block's attention through
    :func:`oracles.attention`), on a left-padded batch."""
    torch.manual_seed(0)
    music = {"name": "music", "max_distance": 4}
    cfg = TransformerConfig(
        **{**BASE, "num_layers": 2, "d_model": 16},
        scheme="sinusoidal",
        layer_schemes=[music, music],
    )
    model = Transformer(cfg).double().eval()
    for block in model.blocks:
        randomize_parameters(block.attn.scheme, seed=1)
    tokens = torch.randint(0, BASE["vocab_size"], (2, 7))
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    p = relpos.Positions.from_padding_mask(mask)
    sinusoid = model.embed.scheme
    x = model.embed.tokens.weight[tokens] * cfg.d_model**0.5
    x = (
        x
        + torch.stack(
            [torch.stack([oracles.embedding(sinusoid, q) for q in row]) for row in p.pos.tolist()]
        ).double()
    )
    for block in model.blocks:
        x = x + oracle_attention_layer(block.attn, block.ln1(x), p)
        x = x + block.mlp(block.ln2(x))
    want = model.head(model.ln_f(x))
    got = model(tokens, padding_mask=mask)
    # float32 sinusoids (angles are float32 by design), float64 everything else
    torch.testing.assert_close(got[mask], want[mask], rtol=1e-6, atol=1e-6)
    assert [type(b.attn.scheme).__name__ for b in model.blocks] == ["MusicRelative"] * 2
