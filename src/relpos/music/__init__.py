"""Four-part Bach chorale data for a Music Transformer (Huang et al., 2018 representation).

* :func:`load_chorales` — the music21 corpus (default, cached) or a JSB JSON file, as
  :class:`ChoraleSplits` of ``(T, 4)`` int16 arrays (16th-note steps × S, A, T, B; ``-1`` silent).
* :mod:`.tokens` — ``encode`` / ``decode`` between chorales and token ids (one token per voice
  per step, S, A, T, B), :data:`VOCAB_SIZE`.
* :mod:`.augment` — transposition within voice ranges (training only).
* :mod:`.dataset` — chorales as a :class:`~relpos.training.TokenDataset` (``load_token_data``).
* :mod:`.generate` — sampling a chorale from a trained model (``sample_chorale``).
* :mod:`.midi` — MIDI / MusicXML output.
* :mod:`.cache` — the versioned, checksummed corpus cache.

music21 and tqdm are imported only when the corpus is parsed or a score written.
"""

from .augment import VOICE_RANGES, allowed_shifts, random_transpose, transpose, voice_ranges
from .cache import CacheWarning, default_cache_dir
from .chorales import load_music21_chorales, split_of
from .dataset import CHORALE_GRID, TokenData, load_token_data
from .generate import sample_chorale
from .jsb import load_jsb_json
from .load import MUSIC21, load_chorales
from .midi import chorale_to_score, write_midi, write_musicxml
from .pianoroll import write_piano_roll
from .splits import (
    NUM_VOICES,
    SILENCE,
    SPLITS,
    VOICE_NAMES,
    ChoraleSplits,
    SplitName,
    check_chorale,
)
from .stats import (
    chorale_statistics,
    compare_chorales,
    parallel_motion,
    pitch_class_distance,
    pitch_class_histogram,
)
from .tokens import (
    BOS,
    EOS,
    MAX_PITCH,
    MIN_PITCH,
    PAD,
    REST,
    VOCAB_SIZE,
    decode,
    encode,
    token_voices,
)

__all__ = [
    "BOS",
    "CHORALE_GRID",
    "EOS",
    "MAX_PITCH",
    "MIN_PITCH",
    "MUSIC21",
    "NUM_VOICES",
    "PAD",
    "REST",
    "SILENCE",
    "SPLITS",
    "VOCAB_SIZE",
    "VOICE_NAMES",
    "VOICE_RANGES",
    "CacheWarning",
    "ChoraleSplits",
    "SplitName",
    "TokenData",
    "allowed_shifts",
    "check_chorale",
    "chorale_statistics",
    "chorale_to_score",
    "compare_chorales",
    "decode",
    "default_cache_dir",
    "encode",
    "load_chorales",
    "load_jsb_json",
    "load_music21_chorales",
    "load_token_data",
    "parallel_motion",
    "pitch_class_distance",
    "pitch_class_histogram",
    "random_transpose",
    "sample_chorale",
    "split_of",
    "token_voices",
    "transpose",
    "voice_ranges",
    "write_midi",
    "write_musicxml",
    "write_piano_roll",
]
