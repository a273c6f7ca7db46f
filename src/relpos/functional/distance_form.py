"""Distance biases in closed form: a per-head function of the signed distance ``δ = p_j - p_i``
with one or two parameters per head, which a kernel evaluates per pair instead of reading a
table (and whose parameters' gradient it sums per query, with no atomic adds).

The forms, with ``a``, ``b`` a head's parameters (``params[h] = (a,)`` or ``(a, b)``):

* ``"linear"``: ``a·δ``: ALiBi, causal (Press et al., 2022, "Train Short, Test Long");
* ``"symmetric_linear"``: ``-a·|δ|``: ALiBi, bidirectional;
* ``"kerple_log"``: ``-a·log(1 + b·|δ|)``: KERPLE's logarithmic kernel (Chi et al., 2022,
  "KERPLE: Kernelized Relative Positional Embedding for Length Extrapolation", §4);
* ``"kerple_power"``: ``-a·|δ|^b``: KERPLE's power kernel (``0 < b <= 2``).
"""

from __future__ import annotations

from typing import NamedTuple

from torch import Tensor

from .alibi import alibi_bias
from .kerple import kerple_bias

__all__ = ["DISTANCE_FORMS", "LINEAR_FORMS", "DistanceForm", "distance_form_bias", "linear_form"]

#: The closed forms, in the order kernels number them (from 1).
DISTANCE_FORMS = ("linear", "symmetric_linear", "kerple_log", "kerple_power")
#: The forms of one parameter per head (ALiBi's slope); the others take two.
LINEAR_FORMS = ("linear", "symmetric_linear")


class DistanceForm(NamedTuple):
    """A distance bias in closed form: ``name`` one of :data:`DISTANCE_FORMS`, ``params``
    float32 or wider, each head's ``(a,)`` (``(h, 1)``: :data:`LINEAR_FORMS`) or ``(a, b)``
    (``(h, 2)``), with its graph to the scheme's parameters (what a kernel returns a gradient
    for)."""

    name: str
    params: Tensor


def distance_form_bias(form: DistanceForm, distance: Tensor) -> Tensor:
    """The bias of every distance for every head, evaluated in PyTorch (what the kernels are
    tested against).

    Shapes:
        distance: ``(D,)`` integer; returns ``(h, D)`` in ``form.params``' dtype.
    """
    if form.name not in DISTANCE_FORMS:
        raise ValueError(f"form.name must be one of {DISTANCE_FORMS}, got {form.name!r}")
    a, b = form.params[:, 0], form.params[:, -1]
    if form.name in LINEAR_FORMS:
        causal = form.name == "linear"
        return alibi_bias(a, distance[None, None], causal=causal)[0, :, 0].to(a.dtype)
    variant = "log" if form.name == "kerple_log" else "power"
    return kerple_bias(distance, a, b, variant=variant)


def linear_form(slopes: Tensor, *, causal: bool) -> DistanceForm:
    """ALiBi's line with these ``(h,)`` slopes as a :class:`DistanceForm` (a view: no op)."""
    return DistanceForm("linear" if causal else "symmetric_linear", slopes[:, None])
