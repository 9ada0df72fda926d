"""Evaluation sets by name: the held-out GEC set, its few-shot prompt, and the registry."""

import pytest

from evaluation.datasets import FEW_SHOT_KINDS, GEC_INSTRUCTION, eval_set, known_eval_sets
from evaluation.gec_data import pairs, split


@pytest.fixture(scope="module")
def parts():
    development, held_out = split(pairs())
    return development, held_out


def test_no_name_means_the_held_out_gec_set():
    assert eval_set(None).name == eval_set().name == "gec-heldout"
    assert eval_set(None) == eval_set("gec-heldout")


def test_unknown_dataset_name_lists_the_known_ones():
    with pytest.raises(KeyError) as error:
        eval_set("squad")
    message = str(error.value)
    assert "squad" in message and all(name in message for name in known_eval_sets())
    assert known_eval_sets() == ["gec-dev", "gec-heldout"]


def test_gec_heldout_asks_about_every_held_out_pair_once(parts):
    _, held_out = parts
    examples = eval_set("gec-heldout").examples
    assert [(e.prompt, e.reference, e.kind) for e in examples] == [(p.source, p.target, p.kind) for p in held_out]
    assert len({e.id for e in examples}) == len(examples)


def test_nll_is_measured_on_the_corrected_held_out_sentences(parts):
    _, held_out = parts
    assert eval_set("gec-heldout").nll_texts == [p.target for p in held_out]


def test_every_prompt_is_the_instruction_three_few_shot_turns_and_the_sentence():
    for example in eval_set("gec-heldout").examples:
        roles = [m["role"] for m in example.messages]
        assert roles == ["system"] + ["user", "assistant"] * 3 + ["user"]
        assert example.messages[0]["content"] == GEC_INSTRUCTION
        assert example.messages[-1]["content"] == example.prompt


def test_all_examples_share_one_fixed_few_shot_prompt():
    few_shots = {str(e.messages[:-1]) for e in eval_set("gec-heldout").examples}
    assert len(few_shots) == 1


def test_few_shot_examples_never_come_from_the_held_out_split(parts):
    development, held_out = parts
    shots = [tuple(m["content"] for m in turn) for turn in zip(*[iter(eval_set().examples[0].messages[1:-1])] * 2)]
    held_out_text = {p.source for p in held_out} | {p.target for p in held_out}
    assert len(shots) == 3
    assert all(source not in held_out_text and target not in held_out_text for source, target in shots)
    assert all(any((p.source, p.target) == shot for p in development) for shot in shots)
    assert [next(p.kind for p in development if p.source == source) for source, _ in shots] == list(FEW_SHOT_KINDS)


def test_gec_dev_is_the_development_split_without_the_few_shot_pairs(parts):
    development, _ = parts
    dev = eval_set("gec-dev")
    shot_sources = {m["content"] for m in dev.examples[0].messages[1:-1] if m["role"] == "user"}
    assert [e.prompt for e in dev.examples] == [p.source for p in development if p.source not in shot_sources]
    assert len(dev.examples) == len(development) - 3
    assert dev.examples[0].messages[:-1] == eval_set("gec-heldout").examples[0].messages[:-1]


def test_example_ids_are_stable_across_calls_and_sets():
    first, again = eval_set("gec-heldout"), eval_set("gec-heldout")
    assert [e.id for e in first.examples] == [e.id for e in again.examples]
    assert not {e.id for e in first.examples} & {e.id for e in eval_set("gec-dev").examples}


def test_a_sample_keeps_every_error_kind_and_is_told_apart_from_the_whole_set():
    whole = eval_set("gec-heldout")
    sample = whole.sample(64)

    assert (sample.name, len(sample.examples), len(sample.nll_texts)) == ("gec-heldout-64of351", 64, 64)
    assert {e.kind for e in sample.examples} == {e.kind for e in whole.examples}
    assert set(sample.references.items()) <= set(whole.references.items())
    assert sample.fingerprint != whole.fingerprint
    assert whole.sample(len(whole.examples)) is whole and whole.sample(None) is whole
