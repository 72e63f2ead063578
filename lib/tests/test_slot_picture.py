"""Chapter 5's block-major picture: the grid it draws, and bad input refused."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from pagedkv.views import plot_slots, slot_owners  # noqa: E402

TABLES = {"A": [7, 2, 9], "B": [4, 11]}
LENGTHS = {"A": 10, "B": 6}


def test_each_written_slot_is_block_times_size_plus_offset():
    grid = slot_owners(TABLES, LENGTHS, 4, 12)
    assert grid[7] == [("A", 0), ("A", 1), ("A", 2), ("A", 3)]
    assert grid[2][0] == ("A", 4)          # position 4: block 2, slot 8
    assert grid[9] == [("A", 8), ("A", 9), ("A", None), ("A", None)]
    assert grid[11] == [("B", 4), ("B", 5), ("B", None), ("B", None)]
    assert grid[0] is not None and grid[0] == [None] * 4  # free block


def test_picture_labels_each_written_slot_with_its_number():
    fig = plot_slots(TABLES, LENGTHS, 4, 12)
    texts = [t.get_text() for t in fig.axes[0].texts]
    assert "A9\nslot 37" in texts and "B5\nslot 45" in texts
    assert texts.count("A tail") == 2 and texts.count("B tail") == 2
    assert len(texts) == 10 + 6 + 4
    assert fig.number not in plt.get_fignums()  # shown once, by the caller


@pytest.mark.parametrize("tables, lengths, message", [
    ({"A": [1]}, {"A": 5}, "need 2 blocks"),
    ({"A": [1], "B": [1]}, {"A": 2, "B": 2}, "held twice"),
    ({"A": [12]}, {"A": 1}, "not below num_blocks"),
    ({"A": [1]}, {"B": 1}, "same requests"),
])
def test_bad_input_is_refused(tables, lengths, message):
    with pytest.raises(ValueError, match=message):
        slot_owners(tables, lengths, 4, 12)


def test_a_float_block_size_is_a_type_error():
    with pytest.raises(TypeError):
        slot_owners(TABLES, LENGTHS, 4.0, 12)
