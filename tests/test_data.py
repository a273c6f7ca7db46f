"""Tests of relpos.music (chorale loaders, cache, tokens, transposition, MIDI output) and of
relpos.training.windows (batching)."""

from __future__ import annotations

import fnmatch
import gzip
import hashlib
import json
import math
import os
import re
import warnings
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from relpos.atomic import atomic_path
from relpos.music import (
    BOS,
    CHORALE_GRID,
    EOS,
    MAX_PITCH,
    MIN_PITCH,
    PAD,
    REST,
    VOCAB_SIZE,
    VOICE_RANGES,
    CacheWarning,
    ChoraleSplits,
    allowed_shifts,
    check_chorale,
    decode,
    encode,
    load_chorales,
    load_jsb_json,
    random_transpose,
    token_voices,
    transpose,
    voice_ranges,
    write_midi,
    write_musicxml,
)
from relpos.music import cache as cache_mod
from relpos.music.cache import (
    CorruptCacheError,
    StaleCacheError,
    cached_splits,
    default_cache_dir,
    load_splits,
    save_splits,
)
from relpos.music.jsb import packaged_jsb_path
from relpos.music.midi import voice_runs
from relpos.training.windows import WindowGrid, eval_windows, random_windows

# --------------------------------------------------------------------------- strategies, helpers


def _chorales(min_steps: int = 0, max_steps: int = 12, ranges=None):
    """Hypothesis strategy: (T, 4) int16 chorales, pitches in the vocabulary or `ranges`."""
    if ranges is None:
        ranges = [(MIN_PITCH, MAX_PITCH)] * 4

    def build(t: int):
        cols = [
            st.lists(st.one_of(st.just(-1), st.integers(lo, hi)), min_size=t, max_size=t).map(
                lambda xs: np.array(xs, dtype=np.int16)
            )
            for lo, hi in ranges
        ]
        return st.tuples(*cols).map(
            lambda cs: np.stack(cs, axis=1) if t else np.zeros((0, 4), np.int16)
        )

    return st.integers(min_steps, max_steps).flatmap(build)


def _splits(seed: int = 0, counts=(3, 2, 1), source: str = "test") -> ChoraleSplits:
    rng = np.random.default_rng(seed)
    data = {}
    for split, n in zip(("train", "valid", "test"), counts, strict=True):
        data[split] = [
            rng.integers(-1, 90, size=(int(rng.integers(1, 20)), 4)).astype(np.int16)
            for _ in range(n)
        ]
        data[f"{split}_names"] = [f"{split}-{i}" for i in range(n)]
    return ChoraleSplits(**data, source=source)


def _assert_same_splits(a: ChoraleSplits, b: ChoraleSplits) -> None:
    for split in ("train", "valid", "test"):
        assert a.names(split) == b.names(split)
        assert len(a.split(split)) == len(b.split(split))
        for x, y in zip(a.split(split), b.split(split), strict=True):
            assert x.dtype == y.dtype == np.int16
            np.testing.assert_array_equal(x, y)


def _leftovers(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".tmp" in p.name)


# --------------------------------------------------------------------------- chorale arrays


def test_check_chorale_accepts_lists_and_returns_int16():
    out = check_chorale([[60, 55, 52, 48], [-1, 55, 52, 48]])
    assert out.dtype == np.int16
    assert out.shape == (2, 4)
    assert check_chorale(np.zeros((0, 4), np.int64)).shape == (0, 4)


@pytest.mark.parametrize(
    ("bad", "exc", "words"),
    [
        (np.zeros((3, 3), np.int16), ValueError, "got shape (3, 3)"),
        (np.zeros(4, np.int16), ValueError, "got shape (4,)"),
        (np.zeros((2, 4), np.float32), TypeError, "float32"),
        (np.full((2, 4), 128), ValueError, "128"),
        (np.full((2, 4), -2), ValueError, "-2"),
        ([[60, 55, 52], [60, 55, 52, 48]], ValueError, "ragged"),
    ],
)
def test_check_chorale_errors(bad, exc, words):
    with pytest.raises(exc, match="my_arg") as info:
        check_chorale(bad, "my_arg")
    assert words in str(info.value)


def test_chorale_splits_is_immutable_and_validated():
    src = np.array([[60, 55, 52, 48]], dtype=np.int16)
    s = ChoraleSplits([src], [], [], ["a"], [], [])
    assert isinstance(s.train, tuple)
    assert src.flags.writeable  # the caller's array is untouched
    with pytest.raises(ValueError, match="read-only"):
        s.train[0][0, 0] = 1
    with pytest.raises(AttributeError):
        s.train = ()  # type: ignore[misc]
    with pytest.raises(ValueError, match="1 train chorales but 2 train_names"):
        ChoraleSplits([src], [], [], ["a", "b"], [], [])
    with pytest.raises(ValueError, match=r"valid\[0\]"):
        ChoraleSplits([], [np.zeros((2, 3), np.int16)], [], [], ["x"], [])
    assert s.num_steps() == 1
    assert s.summary()["train_chorales"] == 1
    with pytest.raises(ValueError, match="split"):
        s.split("dev")  # type: ignore[arg-type]


# --------------------------------------------------------------------------- tokens


def test_vocabulary_constants():
    assert (PAD, BOS, EOS, REST) == (0, 1, 2, 3)
    assert (MIN_PITCH, MAX_PITCH) == (24, 96)
    assert VOCAB_SIZE == 4 + (96 - 24 + 1) == 77


def test_encode_layout():
    c = np.array([[72, 67, 64, 48], [71, -1, 62, 43]])
    t = encode(c)
    assert t.dtype == np.int64
    assert t.tolist() == [BOS, 52, 47, 44, 28, 51, REST, 42, 23, EOS]
    assert encode(c, bos=False, eos=False).tolist() == t[1:-1].tolist()
    assert encode(np.zeros((0, 4), np.int16)).tolist() == [BOS, EOS]
    # every music token of an encoded chorale belongs to voice (p - 1) % 4
    voices = token_voices(t)
    assert voices.tolist() == [-1, 0, 1, 2, 3, 0, 1, 2, 3, -1]


@given(_chorales())
def test_encode_decode_round_trip(chorale):
    tokens = encode(chorale)
    assert len(tokens) == 4 * len(chorale) + 2
    assert ((tokens >= 0) & (tokens < VOCAB_SIZE)).all()
    out = decode(tokens)
    assert out.dtype == np.int16
    np.testing.assert_array_equal(out, chorale)
    np.testing.assert_array_equal(decode(tokens, strict=True), chorale)
    # padded on both sides, or without BOS/EOS: same music
    padded = np.concatenate([[PAD, PAD], tokens, [PAD, PAD, PAD]])
    np.testing.assert_array_equal(decode(padded, strict=True), chorale)
    np.testing.assert_array_equal(decode(encode(chorale, bos=False, eos=False)), chorale)


def test_encode_rejects_pitches_outside_vocabulary():
    with pytest.raises(ValueError, match=r"pitch 100 at step 1, voice 2 .* 24\.\.96"):
        encode([[60, 60, 60, 60], [60, 60, 100, 60]])
    with pytest.raises(ValueError, match=r"shape \(T, 4\).*got shape \(2, 3\)"):
        encode(np.zeros((2, 3), np.int16))


def test_decode_drops_malformed_tokens():
    c = np.array([[72, 67, 64, 48], [71, 67, 62, 43], [72, 64, 60, 48]])
    t = encode(c).tolist()
    # incomplete last step (generation stopped mid-step, no EOS)
    np.testing.assert_array_equal(decode(t[:-3]), c[:2])
    # a special token mid-sequence ends the music; nothing after it is trusted
    for special in (PAD, BOS, EOS):
        bad = [*t[:6], special, *t[6:]]  # inside step 1
        np.testing.assert_array_equal(decode(bad), c[:1])
    bad = [*t[:5], BOS, *t[5:]]  # at a step boundary
    np.testing.assert_array_equal(decode(bad), c[:1])
    # out-of-vocabulary ids also end the music
    np.testing.assert_array_equal(decode([*t[:9], VOCAB_SIZE, *t[9:]]), c[:2])
    np.testing.assert_array_equal(decode([*t[:9], -5, *t[9:]]), c[:2])
    # nothing at all
    assert decode([]).shape == (0, 4)
    assert decode([BOS, EOS]).shape == (0, 4)
    assert decode([BOS, 40, 41]).shape == (0, 4)


@pytest.mark.parametrize(
    ("tokens", "words"),
    [
        ([BOS, 40, 40, 40, 40, 40, EOS], "incomplete"),
        ([BOS, 40, 40, 40, 40, BOS, 40, 40, 40, 40], "unexpected token 1 at position 5"),
        ([BOS, 40, 40, 40, 40, EOS, 40], "unexpected token 2"),
        ([BOS, 40, 40, 40, 40, 99], "unexpected token 99"),
    ],
)
def test_decode_strict_raises(tokens, words):
    with pytest.raises(ValueError, match="tokens") as info:
        decode(tokens, strict=True)
    assert words in str(info.value)


def test_decode_input_errors():
    with pytest.raises(ValueError, match=r"1-D.*\(2, 3\)"):
        decode(np.zeros((2, 3), np.int64))
    with pytest.raises(TypeError, match="float"):
        decode(np.array([1.0, 2.0]))


def test_token_voices_resets_after_specials_and_handles_batches():
    t = np.array(
        [[BOS, 40, 41, 42, 43, 44, 45, EOS, PAD], [40, 41, 42, 43, 44, PAD, PAD, PAD, PAD]]
    )
    v = token_voices(t)
    assert v.dtype == np.int8
    assert v.shape == t.shape
    assert v[0].tolist() == [-1, 0, 1, 2, 3, 0, 1, -1, -1]
    assert v[1].tolist() == [0, 1, 2, 3, 0, -1, -1, -1, -1]
    np.testing.assert_array_equal(token_voices(t[0]), v[0])


# --------------------------------------------------------------------------- transposition


def test_transpose_keeps_silence():
    c = np.array([[60, -1, 52, 40], [-1, 55, -1, 41]], dtype=np.int16)
    out = transpose(c, 3)
    assert out.dtype == np.int16
    assert out.tolist() == [[63, -1, 55, 43], [-1, 58, -1, 44]]
    np.testing.assert_array_equal(transpose(out, -3), c)
    with pytest.raises(ValueError, match=r"semitones: shifting by 100"):
        transpose(c, 100)
    with pytest.raises(TypeError, match="semitones"):
        transpose(c, 1.5)  # type: ignore[arg-type]


@given(_chorales(min_steps=1, ranges=VOICE_RANGES), st.integers(0, 2**32 - 1), st.integers(0, 12))
def test_random_transpose_stays_in_voice_ranges(chorale, seed, max_shift):
    rng = np.random.default_rng(seed)
    shifts = allowed_shifts(chorale, max_shift)
    assert 0 in shifts
    assert shifts.min() >= -max_shift
    assert shifts.max() <= max_shift
    out = random_transpose(chorale, rng, max_shift=max_shift)
    np.testing.assert_array_equal(out == -1, chorale == -1)
    sounding = chorale != -1
    deltas = np.unique(out[sounding].astype(int) - chorale[sounding])
    assert len(deltas) <= 1
    for v, (lo, hi) in enumerate(VOICE_RANGES):
        col = out[:, v][out[:, v] != -1]
        assert ((col >= lo) & (col <= hi)).all()
    encode(out)  # still inside the vocabulary


def test_allowed_shifts_and_out_of_range_chorale():
    c = np.array([[81, 60, 50, 40]])  # soprano at the top of its range
    assert allowed_shifts(c, 6).max() == 0
    assert allowed_shifts(c, 6).min() == -4  # bass 40 → 36
    too_high = np.array([[90, 60, 50, 40]])
    assert allowed_shifts(too_high, 6).size == 0
    np.testing.assert_array_equal(random_transpose(too_high, np.random.default_rng(0)), too_high)
    with pytest.raises(TypeError, match="rng"):
        random_transpose(c, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_shift"):
        allowed_shifts(c, -1)


def test_voice_ranges_from_data():
    chorales = [np.array([[60, 55, -1, 40]]), np.array([[70, 50, 48, -1]])]
    assert voice_ranges(chorales) == ((60, 70), (50, 55), (48, 48), (40, 40))
    with pytest.raises(ValueError, match="voice 2 never sounds"):
        voice_ranges([np.array([[60, 55, -1, 40]])])


# --------------------------------------------------------------------------- batching


def _seqs():
    rng = np.random.default_rng(1)
    lengths = [1, 3, 7, 20, 33]
    return [encode(rng.integers(40, 80, size=(n, 4))) for n in lengths]


@pytest.mark.parametrize("stride", [None, 4, "half", "length"])
@pytest.mark.parametrize("length", [4, 7, 16, 33, 200])
def test_eval_windows_cover_every_target_once(length, stride):
    """Tiled (no stride) or sliding (overlapping windows, each scoring the targets after the
    previous one's): every target once, and with a stride at least ``length - stride`` tokens
    of past (less one step, as windows start on the grid) for every target past the first
    window."""
    seqs = _seqs()
    stride = {"half": max(4, length // 2), "length": length}.get(stride, stride)
    w = eval_windows(seqs, length, grid=CHORALE_GRID, stride=stride)
    assert w.tokens.shape[1] == length + 1
    assert w.tokens.dtype == np.int64
    assert w.mask.dtype == np.bool_
    assert w.num_targets == sum(len(s) - 1 for s in seqs)
    seen = {i: np.zeros(len(s), int) for i, s in enumerate(seqs)}
    seen_rows: list[int] = []
    for row, mask, i, start in zip(w.tokens, w.mask, w.seq_index, w.start, strict=True):
        seq = seqs[i]
        assert start in CHORALE_GRID.boundaries(len(seq))
        n = int(mask.sum())
        assert mask[:n].all()
        assert not mask[n:].any()
        np.testing.assert_array_equal(row[:n], seq[start : start + n])
        assert (row[n:] == PAD).all()
        scored = np.flatnonzero(w.scored[len(seen_rows)])
        seen_rows.append(i)
        assert w.mask[len(seen_rows) - 1][scored].all()
        seen[i][start + scored] += 1
        if stride is not None and start > 0:
            assert scored.min() >= length - stride - CHORALE_GRID.step + 1, (start, scored)
        # voices of the window as seen alone = the voices in the full sequence
        np.testing.assert_array_equal(token_voices(row)[:n], token_voices(seq)[start : start + n])
    for i in range(len(seqs)):
        assert seen[i][0] == 0  # BOS is never a target
        assert (seen[i][1:] == 1).all()
    batches = list(w.batches(3))
    assert sum(len(b) for b in batches) == len(w)
    again = eval_windows(seqs, length, grid=CHORALE_GRID, stride=stride)
    assert again.tokens.tolist() == w.tokens.tolist()  # deterministic
    if stride == length:  # a stride of the window's length is the tiling
        tiled = eval_windows(seqs, length, grid=CHORALE_GRID)
        assert tiled.tokens.tolist() == w.tokens.tolist()
        assert tiled.scored.tolist() == w.scored.tolist()


def test_eval_windows_errors():
    with pytest.raises(ValueError, match="length: expected at least 4"):
        eval_windows(_seqs(), 3, grid=CHORALE_GRID)
    with pytest.raises(TypeError, match="token_seqs"):
        eval_windows(np.zeros((2, 5), np.int64), 8)
    assert len(eval_windows([], 8, grid=CHORALE_GRID)) == 0
    for stride in (3, 9, 0):
        with pytest.raises(ValueError, match=f"stride: expected .*got {stride}"):
            eval_windows(_seqs(), 8, grid=CHORALE_GRID, stride=stride)
    with pytest.raises(ValueError, match="length: expected at least 6"):  # the first boundary
        eval_windows(_seqs(), 5, grid=WindowGrid(step=2, head=6))


def test_random_windows():
    seqs = _seqs()
    rng = np.random.default_rng(0)
    w = random_windows(seqs, 64, 16, rng, grid=CHORALE_GRID)
    assert w.tokens.shape == (64, 17)
    assert w.mask.shape == (64, 17)
    assert w.tokens.dtype == np.int64
    for row, mask, i, start in zip(w.tokens, w.mask, w.seq_index, w.start, strict=True):
        seq = seqs[i]
        assert start in CHORALE_GRID.boundaries(len(seq))
        n = int(mask.sum())
        np.testing.assert_array_equal(row[:n], seq[start : start + n])
        assert (row[~mask] == PAD).all()
        if len(seq) >= 17:
            assert n >= 17 - 3  # at most the tail past the last step boundary is padding
        else:
            assert n == len(seq)
    # the long sequences are sampled more (weighted by length) and EOS is reachable
    assert (w.seq_index == 4).sum() > (w.seq_index == 0).sum()
    many = random_windows(seqs, 2000, 16, np.random.default_rng(1), grid=CHORALE_GRID)
    assert (many.tokens == EOS).any(axis=1)[many.seq_index == 4].any()
    again = random_windows(seqs, 64, 16, np.random.default_rng(0), grid=CHORALE_GRID)
    np.testing.assert_array_equal(again.tokens, w.tokens)
    with pytest.raises(ValueError, match="batch_size"):
        random_windows(seqs, 0, 16, rng, grid=CHORALE_GRID)
    with pytest.raises(TypeError, match="rng"):
        random_windows(seqs, 2, 16, 0, grid=CHORALE_GRID)  # type: ignore[arg-type]


# --------------------------------------------------------------------------- atomic writes


def test_atomic_path_success_and_failure(tmp_path):
    target = tmp_path / "out.bin"
    with atomic_path(target) as tmp:
        assert tmp.parent == tmp_path
        tmp.write_bytes(b"new")
    assert target.read_bytes() == b"new"
    assert _leftovers(tmp_path) == []

    def crash() -> None:
        with atomic_path(target) as tmp:
            tmp.write_bytes(b"half")
            raise RuntimeError("writer crashed")

    with pytest.raises(RuntimeError, match="writer crashed"):
        crash()
    assert target.read_bytes() == b"new"  # old file intact
    assert _leftovers(tmp_path) == []
    with pytest.raises(FileNotFoundError), atomic_path(tmp_path / "nope" / "x"):
        pass


# --------------------------------------------------------------------------- cache


KEY = {"music21_version": "1.0", "params": {"limit": None, "steps_per_quarter": 4}}


def test_cache_round_trip(tmp_path):
    s = _splits()
    path = tmp_path / "c.npz"
    save_splits(path, s, key=KEY)
    assert _leftovers(tmp_path) == []
    loaded = load_splits(path, key=KEY)
    _assert_same_splits(s, loaded)
    assert loaded.source == "test"
    with np.load(path, allow_pickle=False) as z:  # no pickled objects inside
        header = json.loads(z["header"].tobytes())
        assert header["format_version"] == cache_mod.FORMAT_VERSION
        assert header["key"] == KEY
        assert header["checksum"].startswith("sha256:")
        assert z["steps"].dtype == np.int16
        assert z["offsets"].tolist()[0] == 0
        assert z["split"].tolist() == [0, 0, 0, 1, 1, 2]
    empty = ChoraleSplits([], [], [], [], [], [])
    save_splits(tmp_path / "e.npz", empty, key=KEY)
    assert load_splits(tmp_path / "e.npz", key=KEY).num_steps() == 0


def test_cached_splits_builds_once(tmp_path):
    calls = []

    def build():
        calls.append(1)
        return _splits()

    path = tmp_path / "sub" / "c.npz"
    a = cached_splits(path, KEY, build)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a valid cache loads silently
        b = cached_splits(path, KEY, build)
    assert len(calls) == 1
    _assert_same_splits(a, b)
    cached_splits(path, KEY, build, rebuild=True)
    assert len(calls) == 2


def test_cache_never_returns_wrong_data_after_a_flipped_byte(tmp_path):
    """Any single flipped byte: either the file is refused as corrupt, or (a byte the reader
    ignores, e.g. a zip timestamp) the data read back is exactly the original."""
    path = tmp_path / "c.npz"
    original = _splits(seed=1)
    save_splits(path, original, key=KEY)
    good = path.read_bytes()
    refused = 0
    for i in range(0, len(good), 3):
        data = bytearray(good)
        data[i] ^= 0xFF
        path.write_bytes(bytes(data))
        try:
            loaded = load_splits(path, key=KEY)
        except CorruptCacheError:
            refused += 1
        else:
            _assert_same_splits(loaded, original)
    assert refused > len(good) // 3 // 2


def _flip_array_bytes(path: Path, array: np.ndarray) -> None:
    """Flip the bytes of ``array``'s data where they are stored in the (uncompressed) npz."""
    data = bytearray(path.read_bytes())
    raw = np.ascontiguousarray(array).tobytes()
    i = bytes(data).index(raw)
    for j in range(i, i + min(len(raw), 8)):
        data[j] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("array", ["steps", "offsets", "names"])
def test_cache_rebuilt_when_bytes_flipped(tmp_path, array):
    path = tmp_path / "c.npz"
    save_splits(path, _splits(seed=1), key=KEY)
    with np.load(path, allow_pickle=False) as z:
        _flip_array_bytes(path, z[array])
    with pytest.raises(CorruptCacheError):
        load_splits(path, key=KEY)
    with pytest.warns(CacheWarning, match="corrupt"):
        out = cached_splits(path, KEY, lambda: _splits(seed=2))
    _assert_same_splits(out, _splits(seed=2))
    _assert_same_splits(load_splits(path, key=KEY), _splits(seed=2))  # rewritten
    assert _leftovers(tmp_path) == []


def test_cache_checksum_catches_edited_arrays(tmp_path):
    path = tmp_path / "c.npz"
    save_splits(path, _splits(), key=KEY)
    with np.load(path, allow_pickle=False) as z:
        arrays = {k: z[k] for k in z.files}
    arrays["steps"] = arrays["steps"].copy()
    arrays["steps"][0, 0] += 1  # a well-formed file whose data no longer matches its checksum
    np.savez(path, **arrays)
    with pytest.raises(CorruptCacheError, match="checksum"):
        load_splits(path, key=KEY)


@pytest.mark.parametrize("content", [b"", b"not a zip file", b"PK\x03\x04garbage"])
def test_cache_rebuilt_when_unreadable(tmp_path, content):
    path = tmp_path / "c.npz"
    path.write_bytes(content)
    with pytest.warns(CacheWarning, match="corrupt"):
        out = cached_splits(path, KEY, _splits)
    _assert_same_splits(out, _splits())


def test_cache_rebuilt_when_stale(tmp_path, monkeypatch):
    path = tmp_path / "c.npz"
    save_splits(path, _splits(seed=1), key=KEY)
    # another key: music21 version or parameters differ
    other = {**KEY, "music21_version": "2.0"}
    with pytest.raises(StaleCacheError, match=r"2\.0"):
        load_splits(path, key=other)
    with pytest.warns(CacheWarning, match="stale"):
        out = cached_splits(path, other, lambda: _splits(seed=2))
    _assert_same_splits(out, _splits(seed=2))
    assert load_splits(path, key=other).train_names == _splits(seed=2).train_names
    # another format version
    monkeypatch.setattr(cache_mod, "FORMAT_VERSION", cache_mod.FORMAT_VERSION + 1)
    with pytest.raises(StaleCacheError, match="format version"):
        load_splits(path, key=other)
    with pytest.warns(CacheWarning, match="stale"):
        cached_splits(path, other, lambda: _splits(seed=3))
    _assert_same_splits(load_splits(path, key=other), _splits(seed=3))


def test_cache_write_failure_still_returns_data(tmp_path, monkeypatch):
    def fail(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(cache_mod, "save_splits", fail)
    with pytest.warns(CacheWarning, match="disk full"):
        out = cached_splits(tmp_path / "c.npz", KEY, _splits)
    _assert_same_splits(out, _splits())


def test_default_cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("RELPOS_CACHE", str(tmp_path / "x"))
    assert default_cache_dir() == tmp_path / "x"
    monkeypatch.delenv("RELPOS_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "relpos"


# --------------------------------------------------------------------------- JSB JSON


TINY = {
    "train": [[[74, 70, 65, 58], [74, 70, 65, 58], [75, 70, -1, 55]], [[60, 55, 52, 48]]],
    "valid": [[[62, 57, 53, 50]]],
    "test": [[[64, 59, 55, 52], [64, 59, 55, 52]]],
}


def _write_json(tmp_path: Path, data, name: str = "jsb.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return path


def test_jsb_loader_on_tiny_fixture(tmp_path):
    path = _write_json(tmp_path, TINY)
    for source in (path, str(path)):
        s = load_chorales(source)
        assert [len(s.split(k)) for k in ("train", "valid", "test")] == [2, 1, 1]
        assert s.train_names == ("train/000", "train/001")
        assert s.train[0].dtype == np.int16
        assert s.train[0].tolist() == TINY["train"][0]
        assert s.source == str(path)
    assert len(load_chorales(path, limit=1).train) == 1


def test_jsb_loader_tolerances(tmp_path):
    # null / NaN mean silence (as in the .npz edition); integral floats are pitches
    text = '{"train": [[[60.0, null, NaN, 48]]], "valid": [], "test": [], "extra": 1}'
    s = load_jsb_json(_write_json(tmp_path, text))
    assert s.train[0].tolist() == [[60, -1, -1, 48]]
    assert s.valid == ()


@pytest.mark.parametrize(
    ("content", "words"),
    [
        ("{not json", "not valid JSON"),
        ([1, 2], "expected a JSON object"),
        ({"train": [], "valid": []}, "missing key(s) ['test']"),
        ({"train": {}, "valid": [], "test": []}, "'train' must be a list"),
        ({"train": [5], "valid": [], "test": []}, "train chorale 0: expected a list of time steps"),
        ({"train": [[]], "valid": [], "test": []}, "empty chorale"),
        ({"train": [[60, 60]], "valid": [], "test": []}, "step 0: expected a list of 4"),
        ({"train": [[[60, 55, 52]]], "valid": [], "test": []}, "step 0: expected 4 pitches"),
        ({"train": [[[60, 55, 52, 48, 40]]], "valid": [], "test": []}, "got 5"),
        ({"train": [], "valid": [[[60.5, 55, 52, 48]]], "test": []}, "60.5"),
        ({"train": [], "valid": [], "test": [[[60, "C4", 52, 48]]]}, "str 'C4'"),
        ({"train": [[[60, True, 52, 48]]], "valid": [], "test": []}, "True"),
        ({"train": [[[60, 55, 52, 128]]], "valid": [], "test": []}, "0..127, got 128"),
        ({"train": [[[60, 55, -2, 48]]], "valid": [], "test": []}, "got -2"),
        ('{"train": [[[Infinity, 1, 2, 3]]], "valid": [], "test": []}', "inf"),
    ],
)
def test_jsb_loader_wrong_format(tmp_path, content, words):
    path = _write_json(tmp_path, content)
    with pytest.raises(ValueError, match=re.escape(words)) as info:
        load_chorales(path)
    assert str(path) in str(info.value)


def test_jsb_loader_reads_gzip_and_names_a_bad_one(tmp_path):
    content = {"train": [[[60, 55, 52, 48]]], "valid": [], "test": []}
    path = tmp_path / "c.json.gz"
    path.write_bytes(gzip.compress(json.dumps(content).encode()))
    assert load_chorales(path).num_steps("train") == 1
    bad = tmp_path / "bad.json.gz"
    bad.write_bytes(b"{not gzip}")
    with pytest.raises(ValueError, match="not a gzip file") as info:
        load_chorales(bad)
    assert str(bad) in str(info.value)


def test_jsb_name_without_the_packaged_file_says_so(monkeypatch, tmp_path):
    """A build without the package data: ``"jsb"`` names the missing file and the way out."""
    from relpos.music import jsb

    monkeypatch.setattr(jsb, "_PACKAGED", tmp_path / "absent.json.gz")
    with pytest.raises(
        FileNotFoundError, match=r"'jsb': the packaged JSB split .*absent\.json\.gz"
    ):
        load_chorales("jsb")


def test_jsb_loader_missing_file_and_bad_source(tmp_path):
    with pytest.raises(FileNotFoundError):
        load_chorales(tmp_path / "missing.json")
    with pytest.raises(TypeError, match="source"):
        load_chorales(3)  # type: ignore[arg-type]
    path = tmp_path / "bin.json"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ValueError, match="UTF-8"):
        load_chorales(path)


def test_the_packaged_jsb_split_is_the_reference_file():
    """The shipped ``jsb`` split decompresses to the reference file's bytes (the checksum in
    ``relpos/music/data/README.md``) and holds the standard split's counts."""
    raw = gzip.decompress(packaged_jsb_path().read_bytes())
    digest = hashlib.sha256(raw).hexdigest()
    assert digest == "79294cc374f9252e95ef4b703161524c1c53dc1f712c236f00f1c1f5d54af5a7"
    assert digest in (packaged_jsb_path().parent / "README.md").read_text()
    s = load_chorales("jsb")
    assert s.source == str(packaged_jsb_path())
    assert [len(s.split(k)) for k in ("train", "valid", "test")] == [229, 76, 77]
    assert [s.num_steps(k) for k in ("train", "valid", "test")] == [55228, 18408, 18900]
    everything = np.concatenate([c for k in ("train", "valid", "test") for c in s.split(k)])
    sounding = everything[everything != -1]
    assert sounding.min() == 36
    assert sounding.max() == 81
    for c in s.train:  # every chorale tokenises and transposes within the default ranges
        np.testing.assert_array_equal(decode(encode(c)), c)
        assert 0 in allowed_shifts(c)


# --------------------------------------------------------------------------- MIDI / MusicXML


CHORALE = np.array(
    [[72, 67, 64, 48]] * 4 + [[71, 67, 62, 43]] * 2 + [[72, -1, 64, 48]] * 2 + [[-1] * 4] * 2,
    dtype=np.int16,
)


def test_voice_runs_merge_equal_steps():
    assert voice_runs(CHORALE[:, 1]) == [(0, 6, 67), (6, 4, -1)]
    assert voice_runs(np.zeros(0, int)) == []


def test_write_midi_readable_by_music21(tmp_path):
    music21 = pytest.importorskip("music21")
    path = write_midi(CHORALE, tmp_path / "c.mid", tempo_bpm=90)
    assert path == tmp_path / "c.mid"
    assert _leftovers(tmp_path) == []
    score = music21.converter.parse(path, forceSource=True)
    assert len(score.parts) == 4
    soprano = [n.pitch.midi for n in score.parts[0].flatten().notes]
    assert soprano == [72, 71, 72]  # held notes merged
    bass = score.parts[3].flatten().notes
    assert [(n.pitch.midi, float(n.quarterLength)) for n in bass] == [
        (48, 1.0),
        (43, 0.5),
        (48, 0.5),
    ]
    marks = score.flatten().getElementsByClass("MetronomeMark")
    assert marks and math.isclose(marks[0].number, 90)


def test_write_musicxml_round_trip(tmp_path):
    music21 = pytest.importorskip("music21")
    from relpos.music.chorales import score_to_array

    rng = np.random.default_rng(0)
    chorale = np.repeat(rng.integers(40, 80, size=(20, 4)), rng.integers(1, 7, size=20), axis=0)
    chorale[5:9, 2] = -1
    path = write_musicxml(chorale, tmp_path / "c.musicxml", title="test")
    assert _leftovers(tmp_path) == []
    score = music21.converter.parse(path, forceSource=True)
    assert [p.partName for p in score.parts] == ["Soprano", "Alto", "Tenor", "Bass"]
    back = score_to_array(score)
    np.testing.assert_array_equal(back[: len(chorale)], chorale)
    assert (back[len(chorale) :] == -1).all()  # only rests fill the last bar


def test_writers_validate_input(tmp_path):
    with pytest.raises(ValueError, match=r"chorale: expected shape \(T, 4\).*got shape \(5, 3\)"):
        write_midi(np.zeros((5, 3), np.int16), tmp_path / "x.mid")
    with pytest.raises(ValueError, match="tempo_bpm"):
        write_midi(CHORALE, tmp_path / "x.mid", tempo_bpm=0)
    with pytest.raises(ValueError, match=r"chorale: expected shape"):
        write_musicxml([1, 2, 3], tmp_path / "x.musicxml")
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- music21 corpus


def test_music21_loader_limit_and_cache(tmp_path, monkeypatch):
    music21 = pytest.importorskip("music21")
    from relpos.music import chorales as chorales_mod

    s = load_chorales(cache_dir=tmp_path, progress=False, limit=2)
    names = [n for k in ("train", "valid", "test") for n in s.names(k)]
    assert len(names) == 2
    assert all(n.startswith("bach/bwv") for n in names)
    for k in ("train", "valid", "test"):
        for name, c in zip(s.names(k), s.split(k), strict=True):
            assert chorales_mod.split_of(name) == k
            assert c.dtype == np.int16
            assert c.shape[1] == 4
            assert len(c) >= 16
            np.testing.assert_array_equal(decode(encode(c)), c)
    assert s.source == f"music21 {music21.__version__} corpus"
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["music21-bach-chorales-limit2.npz"]

    # a second call reads the cache: no parsing
    def no_parse(**kwargs):
        raise AssertionError("parsed although the cache is valid")

    monkeypatch.setattr(chorales_mod, "parse_music21_chorales", no_parse)
    _assert_same_splits(load_chorales("music21", cache_dir=tmp_path, limit=2), s)
    monkeypatch.undo()

    # another music21 version makes the cache stale: rebuilt with a warning
    monkeypatch.setattr(music21, "__version__", "0.0.1")
    with pytest.warns(CacheWarning, match="stale"):
        again = load_chorales(cache_dir=tmp_path, progress=False, limit=2)
    _assert_same_splits(again, s)
    assert load_chorales(cache_dir=tmp_path, limit=2).source == "music21 0.0.1 corpus"


def test_music21_score_to_array_details():
    music21 = pytest.importorskip("music21")
    from relpos.music.chorales import score_to_array

    score = music21.stream.Score()
    for name, pitches in [
        ("Soprano", ["C5", ["E5", "G5"]]),  # a chord: highest note wins
        ("Alto", ["G4", "F4"]),
        ("Tenor", ["E4", "D4"]),
        ("Bass", ["C3", "G2"]),
    ]:
        part = music21.stream.Part(id=name)
        part.partName = name
        for p in pitches:
            n = music21.chord.Chord(p) if isinstance(p, list) else music21.note.Note(p)
            n.quarterLength = 0.5
            part.append(n)
        grace = music21.note.Note("A5").getGrace()
        part.insert(0.25, grace)  # grace notes are ignored
        score.insert(0, part)
    arr = score_to_array(score)
    assert arr.tolist() == [[72, 67, 64, 48]] * 2 + [[79, 65, 62, 43]] * 2
    score.remove(score.parts[0])
    with pytest.raises(ValueError, match="expected 4 parts"):
        score_to_array(score)


def test_music21_repeats_are_expanded():
    music21 = pytest.importorskip("music21")
    from relpos.music.chorales import score_to_array

    score = music21.stream.Score()
    for name, (a, b) in zip(
        ("Soprano", "Alto", "Tenor", "Bass"),
        [("C5", "D5"), ("G4", "A4"), ("E4", "F4"), ("C3", "D3")],
        strict=True,
    ):
        part = music21.stream.Part(id=name)
        part.partName = name
        for i, p in enumerate((a, b)):
            m = music21.stream.Measure(number=i + 1)
            if i == 0:
                m.insert(0, music21.meter.TimeSignature("2/4"))
            m.append(music21.note.Note(p, quarterLength=2))
            if i == 1:
                m.rightBarline = music21.bar.Repeat(direction="end")
            part.append(m)
        score.insert(0, part)
    as_written = score_to_array(score, expand_repeats=False)
    assert as_written.tolist() == [[72, 67, 64, 48]] * 8 + [[74, 69, 65, 50]] * 8
    performed = score_to_array(score)
    assert performed.tolist() == as_written.tolist() * 2


def test_split_of_is_deterministic_and_groups_versions():
    from relpos.music.chorales import split_of

    assert split_of("bach/bwv18.5-lz") == split_of("bach/bwv18.5-w") == split_of("bach/bwv18.5")
    assert split_of("bach/bwv66.6") == split_of("bach/bwv66.6")
    counts = {k: 0 for k in ("train", "valid", "test")}
    for i in range(2000):
        counts[split_of(f"bach/bwv{i}.1")] += 1
    assert 0.75 < counts["train"] / 2000 < 0.85
    assert 0.07 < counts["valid"] / 2000 < 0.13


@pytest.mark.slow
def test_music21_full_corpus(tmp_path):
    pytest.importorskip("music21")
    s = load_chorales(cache_dir=tmp_path, progress=False)
    counts = [len(s.split(k)) for k in ("train", "valid", "test")]
    assert sum(counts) == 365
    assert counts == [291, 39, 35]
    assert [s.num_steps(k) for k in ("train", "valid", "test")] == [72176, 10156, 9028]
    names = [n for k in ("train", "valid", "test") for n in s.names(k)]
    assert len(set(names)) == len(names)
    for k in ("train", "valid", "test"):
        for c in s.split(k):
            np.testing.assert_array_equal(decode(encode(c)), c)
            assert allowed_shifts(c).size > 0
    assert os.path.getsize(tmp_path / "music21-bach-chorales.npz") > 0


def test_the_packaged_split_is_in_the_wheels_package_data():
    """``pyproject.toml``'s package data names the split and its README, so a wheel (not only a
    clone) carries ``--data jsb``."""
    tomllib = pytest.importorskip("tomllib")
    root = Path(__file__).resolve().parents[1]
    patterns = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"][
        "package-data"
    ]["relpos"]
    package = root / "src" / "relpos"
    for path in (packaged_jsb_path(), packaged_jsb_path().parent / "README.md"):
        rel = path.relative_to(package).as_posix()
        assert any(fnmatch.fnmatch(rel, p) for p in patterns), (rel, patterns)
