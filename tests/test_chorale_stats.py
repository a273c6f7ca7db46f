"""Statistics of chorales (parallel fifths and octaves, crossings, range, pitch classes) on
hand-made chorales with known counts, and the piano-roll image."""

from __future__ import annotations

import numpy as np
import pytest

from relpos.music import (
    chorale_statistics,
    compare_chorales,
    parallel_motion,
    pitch_class_distance,
    pitch_class_histogram,
    write_piano_roll,
)

# S, A, T, B. Step 0 -> 1: every voice rises a step; S-B and S-T move in parallel fifths
# (19 and 7 semitones), T-B in parallel octaves (12); the alto's pairs change interval.
# Step 1 -> 2: only the soprano moves (oblique motion: nothing counted).
# Step 2 -> 3: soprano up a fourth, bass down a fourth, a fifth (modulo 12) before and after:
# contrary motion, not counted. Step 3 -> 4: the tenor falls silent (nothing counted for it).
HAND_MADE = [
    [67, 64, 60, 48],
    [69, 65, 62, 50],
    [72, 65, 62, 50],
    [77, 65, 62, 45],
    [79, 65, -1, 47],
]


def test_parallel_fifths_and_octaves_of_a_hand_made_chorale():
    assert parallel_motion(HAND_MADE) == {"fifths": 2, "octaves": 1}


def test_held_notes_and_silence_are_not_parallel_motion():
    held = [[67, 64, 60, 48]] * 6  # the same fifths and octaves, held: no motion at all
    assert parallel_motion(held) == {"fifths": 0, "octaves": 0}
    # Bass and soprano rise in fifths, but the bass is silent on the second step.
    assert parallel_motion([[67, -1, -1, 60], [69, -1, -1, -1]]) == {"fifths": 0, "octaves": 0}
    assert parallel_motion([[67, -1, -1, 60], [69, -1, -1, 62]]) == {"fifths": 1, "octaves": 0}
    # Unisons count with octaves (0 modulo 12); a third does not count.
    assert parallel_motion([[60, 60, -1, 40], [62, 62, -1, 42]]) == {"fifths": 0, "octaves": 1}
    assert parallel_motion(np.zeros((0, 4), int)) == {"fifths": 0, "octaves": 0}


def test_rates_are_per_hundred_steps():
    stats = chorale_statistics(HAND_MADE)
    assert stats["steps"] == 5
    assert stats["parallel_fifths"] == pytest.approx(2 * 100 / 5)
    assert stats["parallel_octaves"] == pytest.approx(1 * 100 / 5)
    assert stats["voice_crossings"] == 0 and stats["out_of_range"] == 0


def test_a_primed_prefix_is_context_but_motion_out_of_it_counts():
    """``skip=k``: the first k steps are not counted, yet the parallel fifths and octave from
    the last skipped step (0) into the first counted one (1) are."""
    stats = chorale_statistics(HAND_MADE, skip=1)
    assert stats["steps"] == 4
    assert stats["parallel_fifths"] == pytest.approx(2 * 100 / 4)
    assert stats["parallel_octaves"] == pytest.approx(1 * 100 / 4)
    later = chorale_statistics(HAND_MADE, skip=2)  # the motion 0 -> 1 is inside the context
    assert later["parallel_fifths"] == later["parallel_octaves"] == 0
    assert chorale_statistics(HAND_MADE, skip=5)["steps"] == 0
    both = compare_chorales([HAND_MADE], [HAND_MADE], skip=1)
    assert both["generated"]["steps"] == 4 and both["real"]["steps"] == 5
    with pytest.raises(ValueError, match="skip"):
        chorale_statistics(HAND_MADE, skip=-1)


def test_crossings_and_out_of_range_notes_are_counted_per_step():
    chorale = [
        [60, 64, 55, 48],  # alto above soprano: one crossing
        [60, 64, 55, 48],  # held: counted again (per step)
        [90, 64, 60, 67],  # soprano out of range (57..81); bass above tenor; bass out (36..66)
        [72, -1, 60, 48],  # a silent alto crosses nothing
    ]
    stats = chorale_statistics(chorale)
    assert stats["voice_crossings"] == pytest.approx(3 * 100 / 4)
    assert stats["out_of_range"] == pytest.approx(2 * 100 / 4)


def test_pitch_class_histogram_and_distance():
    c_major = [[72, 67, 64, 48]]  # C G E C
    assert pitch_class_histogram([c_major]).tolist() == pytest.approx(
        [0.5, 0, 0, 0, 0.25, 0, 0, 0.25, 0, 0, 0, 0]
    )
    assert pitch_class_distance([c_major], [c_major]) == 0.0
    assert pitch_class_distance([[[60, 48, -1, -1]]], [[[67, 55, -1, -1]]]) == 1.0
    assert pitch_class_histogram([[[-1, -1, -1, -1]]]).sum() == 0


def test_comparison_weighs_chorales_by_length():
    long_clean = [[67, 64, 60, 48]] * 95
    result = compare_chorales([HAND_MADE, long_clean], [long_clean])
    # 2 fifths in 100 steps in all: 2 per 100, not the mean of 40 and 0.
    assert result["generated"]["parallel_fifths"] == pytest.approx(2.0)
    assert result["real"]["parallel_fifths"] == 0.0
    assert 0.0 < result["pitch_class_distance"] < 1.0
    with pytest.raises(ValueError, match="at least one chorale"):
        compare_chorales([], [long_clean])


@pytest.mark.parametrize("bad", [[[60, 60, 60]], np.zeros((3, 4)) + 0.5])
def test_a_malformed_chorale_is_a_clear_error(bad):
    with pytest.raises((TypeError, ValueError), match="chorale"):
        chorale_statistics(bad)


def test_piano_roll_is_a_png_written_atomically(tmp_path):
    out = write_piano_roll(HAND_MADE, tmp_path / "roll.png", title="hand-made")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert [p.name for p in tmp_path.iterdir()] == ["roll.png"]


def test_piano_roll_marks_where_the_prime_ends(tmp_path):
    """A primed sample shades its prime and draws a line where generation begins; the image
    differs from the unmarked one only by that mark (same size)."""
    image = pytest.importorskip("matplotlib.image")
    plain = image.imread(write_piano_roll(HAND_MADE, tmp_path / "plain.png"))
    marked = image.imread(write_piano_roll(HAND_MADE, tmp_path / "marked.png", prime_steps=4))
    assert plain.shape == marked.shape
    assert (plain != marked).any()
    for bad, exc in [(-1, ValueError), (len(HAND_MADE) + 1, ValueError), (1.5, TypeError)]:
        with pytest.raises(exc, match="prime_steps"):
            write_piano_roll(HAND_MADE, tmp_path / "bad.png", prime_steps=bad)
    assert not (tmp_path / "bad.png").exists()
