"""Rotary embeddings over several position axes: M-RoPE and axial (2-D / 3-D) RoPE.

A token may carry one coordinate per axis (row and column of an image patch; time, height and
width of a video token). The rotary pairs ``m < r/2`` are split into contiguous *sections*, one per
axis; pair ``m`` of section ``s`` turns by ``coord[s]·ω'_m``:

==========  =================================================================================
variant     frequencies ``ω'_m``
==========  =================================================================================
M-RoPE      the usual ladder ``ω_m = θ^(-2m/r)`` over all ``r/2`` pairs (or a long-context
            scaling of it); section ``s`` reads axis ``s`` (Wang et al., 2024, "Qwen2-VL",
            §2.1; Hugging Face's ``mrope_section``, e.g. ``[16, 24, 24]`` for head dim 128)
axial       every section has its own full ladder: pair ``m`` of a section of ``S`` pairs
            turns at ``θ^(-2m/(2S))`` (Heo et al., 2024, "Rotary Position Embedding for Vision
            Transformer", RoPE-Axial; the 2-D rotary of Qwen2-VL's vision encoder)
==========  =================================================================================

Which features form pair ``m`` is :func:`~relpos.functional.rope.apply_rope`'s choice (half-split
or interleaved); sections index pairs, so they compose with either layout. With one coordinate
per token (no ``coords``) every axis reads the position, so M-RoPE is then exactly plain RoPE.

Shape legend: ``b`` batch, ``n`` tokens, ``a`` axes, ``r`` rotated features (``r/2`` pairs).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..spec.rope import axial_frequencies as spec_axial_frequencies
from ..spec.rope import check_sections, split_mrope_scaling
from .rope import reduced_angles

__all__ = [
    "axial_frequencies",
    "axis_angles",
    "axis_frequencies",
    "check_sections",
    "pair_axes",
    "split_mrope_scaling",
]


def axial_frequencies(
    sections: Sequence[int], theta: float, device: torch.device | str | None = None
) -> Tensor:
    """One full ladder per axis (:func:`relpos.spec.rope.axial_frequencies`, as a tensor).

    Returns:
        float32 ``(r/2,)``, ``r/2 = sum(sections)``, the sections one after another.
    """
    return torch.from_numpy(spec_axial_frequencies(sections, theta)).to(device)


def axis_frequencies(
    ladder: Tensor,
    rotary_dim: int,
    theta: float,
    sections: Sequence[int] | None,
    *,
    axial: bool = False,
) -> Tensor:
    """The frequencies ``ω'_m`` of a rotary config with ``sections``.

    Args:
        ladder: ``(r/2,)`` the one-axis frequencies (plain or scaled), kept for M-RoPE.
        rotary_dim: ``r``; the sections must sum to ``r/2``.
        theta: the base of the per-axis ladders when ``axial``.
        sections: rotary pairs per axis, or None (one axis: the ladder as is).
        axial: one full ladder per section (:func:`axial_frequencies`) instead of ``ladder``.

    Returns:
        float32 ``(r/2,)``.
    """
    if sections is None:
        return ladder
    check_sections(sections, rotary_dim)
    return axial_frequencies(sections, theta, device=ladder.device) if axial else ladder


def pair_axes(sections: Sequence[int], device: torch.device | str | None = None) -> Tensor:
    """The axis each rotary pair reads: ``s`` for the ``sections[s]`` pairs of section ``s``.

    Returns:
        int64 ``(r/2,)``, e.g. ``[0, 0, 1, 1, 1]`` for sections ``(2, 3)``.
    """
    counts = torch.tensor(list(sections), dtype=torch.long, device=device)
    return torch.repeat_interleave(torch.arange(len(sections), device=device), counts)


def axis_angles(coords: Tensor, inv_freq: Tensor, pair_axis: Tensor) -> Tensor:
    """Rotation angle ``coords[..., axis(m)]·ω'_m`` per token and pair, at least float32, modulo
    ``2π`` (:func:`~relpos.functional.rope.reduced_angles`: exact at any coordinate).

    Args:
        coords: ``(b, n, a)`` integer coordinates, one per axis.
        inv_freq: ``(r/2,)`` frequencies ``ω'_m`` (:func:`axial_frequencies`, or the plain or
            scaled ladder for M-RoPE).
        pair_axis: ``(r/2,)`` int64, the axis of every pair (:func:`pair_axes`); every entry
            ``< a``.

    Returns:
        ``(b, n, r/2)`` angles, the input of :func:`~relpos.functional.rope.apply_rope`.
    """
    return reduced_angles(coords.index_select(-1, pair_axis), inv_freq)
