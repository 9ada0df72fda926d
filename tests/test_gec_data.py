"""The GEC evaluation set: large enough, deterministic, one error per pair, a stable held-out part."""

from collections import Counter

from evaluation.gec_data import SET_SIZE, pairs, split


def test_the_set_has_at_least_300_distinct_pairs_of_every_kind():
    data = pairs()
    assert len(data) == SET_SIZE >= 300
    assert len({p.source for p in data}) == len(data)
    kinds = Counter(p.kind for p in data)
    assert set(kinds) == {"agreement", "tense", "article", "plural", "preposition", "capitalization"}
    assert min(kinds.values()) >= 50


def test_the_same_seed_gives_the_same_set_and_another_seed_another():
    assert pairs() == pairs()
    assert pairs(seed=1) != pairs()


def test_every_pair_has_exactly_one_difference_and_a_correct_target():
    for pair in pairs():
        assert pair.source != pair.target
        assert pair.target[0].isupper() and pair.target.endswith(".")
        if pair.kind != "capitalization":
            changed = [(a, b) for a, b in zip(pair.source.split(), pair.target.split()) if a != b]
            assert len(changed) == 1, pair


def test_held_out_part_is_disjoint_stable_and_about_a_quarter():
    development, held_out = split(pairs())
    assert not {p.source for p in development} & {p.source for p in held_out}
    assert 0.15 < len(held_out) / SET_SIZE < 0.35
    # Growing the set never moves a pair between the parts.
    _, held_out_bigger = split(pairs(size=SET_SIZE + 60))
    assert {p.source for p in held_out} <= {p.source for p in held_out_bigger}
