"""The quality guard's match fractions (bench/quality.py), over hand-made greedy tokens."""
from bench.quality import compare

EOS = {0}


def test_positions_count_up_to_the_references_first_eos():
    ref = [[5, 6, 0, 9, 9], [1, 2, 3, 4, 5]]
    same = [[5, 6, 0, 7, 7], [1, 2, 3, 4, 5]]   # differs only after the reference's EOS
    got = compare(ref, same, EOS)
    assert got == {"positions": 3 + 5, "positional_match": 1.0, "prefix_match": 1.0}


def test_prefix_stops_at_the_first_divergence_positional_does_not():
    ref = [[1, 2, 3, 4]]
    other = [[1, 9, 3, 4]]
    got = compare(ref, other, EOS)
    assert got["positional_match"] == 0.75
    assert got["prefix_match"] == 0.25
