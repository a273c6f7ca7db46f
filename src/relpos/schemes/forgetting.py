"""The Forgetting Transformer's forget gate (Lin, Nikishin, He and Courville, 2025, "Forgetting
Transformer: Softmax Attention with a Forget Gate", ICLR 2025)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..functional.dtypes import compute_dtype
from ..spec.forgetting import ForgetGateConfig
from .base import DecayBiasScheme, register

__all__ = ["ForgetGate", "ForgetGateConfig"]


@register
class ForgetGate(DecayBiasScheme):
    """Forgetting Attention: softmax attention whose logits decay by a data-dependent forget gate.

    Every head ``h`` has a scalar forget gate per token, ``f_t = σ(w_h·x_t + b_h)``, from the
    attention layer's input ``x_t``; query ``i`` and an earlier key ``j`` of the same sequence get
    ``q_i·k_j/√d + Σ_{l=j+1}^{i} log f_l`` (the paper's eq. 5, ``D_ij``): a learned, content-
    dependent ALiBi. With ``c_t = Σ_{l <= t} log f_l`` the term is ``c_i − c_j``. No other
    positional information is needed (the paper runs it without RoPE); combine it with another
    scheme per layer through ``TransformerConfig.layer_schemes``.

    Per-row correctness: the sums run over each token's own sequence, in position order, so a
    packed document restarts at 0, padding tokens add nothing (their gates are ignored), and the
    KV cache stores each token's ``c_t`` (``Positions.log_decay``), so decoding one token or a
    chunk at a time continues each row's sum exactly where its prompt left it, whatever its
    padding (the official code assumes no padding when decoding).

    Causal only (the sum runs from the key to a later query): ``causal=False`` raises a
    ``ValueError``; self-attention only (the gates come from the layer's own tokens):
    ``MultiheadAttention`` refuses ``context=``.

    Parameters: ``gate`` (``nn.Linear(d_model, num_heads)``), initialised as in the paper's code:
    weights ``N(0, 0.02²)``, bias 0 (``f ≈ 1/2`` at first).

    Precision: ``log f`` is computed in at least float32 (``log σ`` by ``logsigmoid``, never
    ``-inf`` for a finite input), its cumulative sums in float64, and ``c_i − c_j`` in float64
    before the cast to float32, so the bias keeps float32's relative precision however long the
    sequence (``tests/test_forgetting.py`` checks 4096 tokens against a float64 reference).

    Shapes:
        ``contextualize(x (b, n, d_model), positions)`` gives ``log_decay (b, n, h)`` float64;
        ``score_bias`` returns ``(b, h, i, j)`` in ``q``'s compute dtype (float32 for fp16 /
        bf16 / fp32).
    """

    config_class = ForgetGateConfig

    def __init__(self, config: ForgetGateConfig | None = None, **dims) -> None:
        super().__init__(config, **dims)
        self.gate = nn.Linear(self.d_model, self.num_heads)
        with torch.no_grad():
            self.gate.weight.normal_(0.0, 0.02)
            self.gate.bias.zero_()

    def token_log_decay(self, x: Tensor) -> Tensor:
        dtype = compute_dtype(x.dtype)
        w, b = self.gate.weight.to(dtype), self.gate.bias.to(dtype)
        return F.logsigmoid(F.linear(x.to(dtype), w, b))  # (b, n, h)
