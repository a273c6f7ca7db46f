"""Token representation of four-part chorales (Huang et al., 2018, "Music Transformer", §5.1).

The Music Transformer paper serialises the JSB chorales "in a grid-like fashion": at every
16th-note step the four voices are written soprano, alto, tenor, bass, one token per voice per
step, so a chorale of ``T`` steps becomes ``4·T`` music tokens. A silent voice is its own token
(:data:`REST`); a held note and a repeated note look the same (the grid only says which pitch
sounds at each step).

Vocabulary (:data:`VOCAB_SIZE` = 77 ids)::

    0  PAD    padding (never a target)
    1  BOS    start of a chorale
    2  EOS    end of a chorale
    3  REST   the voice is silent at this step
    4..76     MIDI pitches MIN_PITCH..MAX_PITCH = 24..96 (C1..C7), id = pitch - 20

The pitch range 24..96 holds every pitch of both data sets (the JSB file spans 36..81, the music21
corpus 36..81) plus more than an octave either side, so any transposition that keeps the voices
inside :data:`relpos.music.augment.VOICE_RANGES` stays in the vocabulary.

An encoded chorale is ``[BOS, s0, a0, t0, b0, s1, a1, t1, b1, ..., EOS]`` (``4·T + 2`` ids), so the
music token at position ``p ≥ 1`` belongs to voice ``(p - 1) % 4``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .splits import NUM_VOICES, SILENCE, check_chorale

__all__ = [
    "BOS",
    "EOS",
    "MAX_PITCH",
    "MIN_PITCH",
    "PAD",
    "REST",
    "SPECIAL_TOKENS",
    "VOCAB_SIZE",
    "decode",
    "encode",
    "is_music_token",
    "pitch_to_token",
    "token_to_pitch",
    "token_voices",
]

PAD = 0
BOS = 1
EOS = 2
REST = 3
#: Tokens that are not music (never part of a step).
SPECIAL_TOKENS = (PAD, BOS, EOS)
#: Lowest and highest MIDI pitch with a token (inclusive).
MIN_PITCH = 24
MAX_PITCH = 96
_PITCH_BASE = REST + 1  # token id of MIN_PITCH
#: Number of token ids: 4 specials/REST + 73 pitches.
VOCAB_SIZE = _PITCH_BASE + (MAX_PITCH - MIN_PITCH + 1)


def _as_int_array(tokens: Any, name: str) -> np.ndarray:
    arr = np.asarray(tokens)
    if arr.size == 0 and arr.dtype.kind == "f":  # np.asarray([]) is float64
        arr = arr.astype(np.int64)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{name}: expected integer token ids, got dtype {arr.dtype}")
    return arr


def pitch_to_token(pitch: Any) -> np.ndarray:
    """Token ids of MIDI pitches (``-1`` → :data:`REST`), elementwise.

    Raises:
        ValueError: a pitch outside ``MIN_PITCH..MAX_PITCH`` (other than ``-1``).
    """
    p = _as_int_array(pitch, "pitch").astype(np.int64)
    bad = (p != SILENCE) & ((p < MIN_PITCH) | (p > MAX_PITCH))
    if bad.any():
        raise ValueError(
            f"pitch: expected -1 (silent) or a MIDI pitch in {MIN_PITCH}..{MAX_PITCH} (the "
            f"vocabulary), got {int(p[bad].flat[0])}"
        )
    return np.where(p == SILENCE, REST, p - MIN_PITCH + _PITCH_BASE)


def token_to_pitch(tokens: Any) -> np.ndarray:
    """MIDI pitches of music token ids (:data:`REST` → ``-1``), elementwise, as ``int16``.

    Raises:
        ValueError: a special token (PAD/BOS/EOS) or an id outside the vocabulary.
    """
    t = _as_int_array(tokens, "tokens").astype(np.int64)
    bad = ~is_music_token(t)
    if bad.any():
        raise ValueError(
            f"tokens: expected music tokens (REST={REST} or pitch ids {_PITCH_BASE}.."
            f"{VOCAB_SIZE - 1}), got {int(t[bad].flat[0])}"
        )
    return np.where(t == REST, SILENCE, t - _PITCH_BASE + MIN_PITCH).astype(np.int16)


def is_music_token(tokens: Any) -> np.ndarray:
    """Boolean mask: ``True`` where an id is REST or a pitch (a voice of a step)."""
    t = _as_int_array(tokens, "tokens")
    return (t >= REST) & (t < VOCAB_SIZE)


def encode(chorale: Any, *, bos: bool = True, eos: bool = True) -> np.ndarray:
    """Serialise a ``(T, 4)`` chorale into ``int64`` token ids ``[BOS, s0, a0, t0, b0, ..., EOS]``.

    Args:
        chorale: ``(T, 4)`` integer array, columns S, A, T, B, ``-1`` = silent.
        bos, eos: whether to add the BOS / EOS tokens.

    Raises:
        ValueError: wrong shape, or a pitch outside ``MIN_PITCH..MAX_PITCH`` (the message names
            the step and voice).
    """
    arr = check_chorale(chorale, "chorale").astype(np.int64)
    bad = (arr != SILENCE) & ((arr < MIN_PITCH) | (arr > MAX_PITCH))
    if bad.any():
        step, voice = (int(i) for i in np.argwhere(bad)[0])
        raise ValueError(
            f"chorale: pitch {int(arr[step, voice])} at step {step}, voice {voice} is outside "
            f"the vocabulary range {MIN_PITCH}..{MAX_PITCH}"
        )
    music = np.where(arr == SILENCE, REST, arr - MIN_PITCH + _PITCH_BASE).reshape(-1)
    parts = [np.array([BOS], np.int64)] if bos else []
    parts.append(music)
    if eos:
        parts.append(np.array([EOS], np.int64))
    return np.concatenate(parts).astype(np.int64, copy=False)


def decode(tokens: Any, *, strict: bool = False) -> np.ndarray:
    """Turn token ids back into a ``(T, 4)`` ``int16`` chorale, keeping only well-formed steps.

    Reading rules (so nothing that breaks the S, A, T, B order reaches a file):

    * leading PADs and one leading BOS are skipped;
    * the music is the run of music tokens (REST or pitch) that follows; the first token that is
      not music ends it — EOS normally, but also a PAD, a BOS or an out-of-vocabulary id in the
      middle, after which the voice order can no longer be trusted, so everything from there on
      is dropped;
    * an incomplete last step (fewer than 4 tokens) is dropped.

    Args:
        tokens: 1-D integer token ids (numpy array, list, or anything ``np.asarray`` takes; a
            torch tensor should be moved to CPU first).
        strict: raise ``ValueError`` instead of dropping anything: an incomplete last step, or
            a music end other than EOS followed only by PADs, is then an error (a sequence that
            simply stops, without EOS, is still fine).

    Returns:
        ``int16`` array of shape ``(T, 4)``; ``T`` may be 0.
    """
    t = _as_int_array(tokens, "tokens")
    if t.ndim != 1:
        raise ValueError(f"tokens: expected a 1-D sequence of token ids, got shape {t.shape}")
    t = t.astype(np.int64, copy=False)
    start = 0
    while start < len(t) and t[start] == PAD:
        start += 1
    if start < len(t) and t[start] == BOS:
        start += 1
    body = t[start:]
    not_music = np.flatnonzero(~is_music_token(body))
    end = int(not_music[0]) if not_music.size else len(body)
    if strict:
        tail = body[end:]
        if tail.size and not (tail[0] == EOS and np.all(tail[1:] == PAD)):
            raise ValueError(
                f"tokens: unexpected token {int(tail[0])} at position {start + end} "
                f"(only PADs may follow EOS, and no PAD/BOS/unknown id may interrupt the music)"
            )
        if end % NUM_VOICES:
            raise ValueError(
                f"tokens: {end} music tokens is not a whole number of {NUM_VOICES}-voice steps "
                f"(the last step is incomplete)"
            )
    steps = end // NUM_VOICES
    music = body[: steps * NUM_VOICES].reshape(steps, NUM_VOICES)
    return token_to_pitch(music).reshape(steps, NUM_VOICES)


def token_voices(tokens: Any) -> np.ndarray:
    """Voice index (0=S, 1=A, 2=T, 3=B) of every position of a token sequence; ``-1`` for tokens
    that are not music (PAD/BOS/EOS/unknown ids).

    Music tokens are counted from the start of the row and restart after every special token, so
    this is right for encoded chorales (``[BOS, s0, a0, ...]``), for windows that start with BOS
    or at a step boundary (all windows from :mod:`relpos.training.windows` do), and for padded
    batches. Works on 1-D sequences and 2-D ``(batch, length)`` arrays; returns ``int8`` of the
    same shape.
    """
    t = _as_int_array(tokens, "tokens")
    if t.ndim not in (1, 2):
        raise ValueError(f"tokens: expected a 1-D or 2-D array of token ids, got shape {t.shape}")
    rows = t.reshape(1, -1) if t.ndim == 1 else t
    music = is_music_token(rows)
    pos = np.broadcast_to(np.arange(rows.shape[1]), rows.shape)
    last_special = np.maximum.accumulate(np.where(music, -1, pos), axis=1)
    voices = np.where(music, (pos - last_special - 1) % NUM_VOICES, -1).astype(np.int8)
    return voices.reshape(t.shape)
