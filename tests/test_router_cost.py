"""The router's price of a request in model units, from the cost model's coefficients."""

import pytest

from serving.router.cost import DEFAULT_OUTPUT_TOKENS, RouteCost, input_tokens, output_tokens, request_units, updated_mean

COST = RouteCost(alpha_ms_per_input_token=0.5, beta_ms_per_output_token=20.0, gamma_ms=30.0, concurrency=4)


def test_the_worked_example_of_the_module():
    assert request_units({"prompt": "x" * 400, "max_tokens": 10}, COST, None) == pytest.approx(70.0)


def test_token_ids_count_exactly_and_text_by_four_characters_a_token():
    assert input_tokens({"prompt": [5, 6, 7]}) == 3
    assert input_tokens({"prompt": "abcdefghi"}) == 3
    assert input_tokens({"messages": [{"role": "user", "content": "a" * 8},
                                      {"role": "user", "content": [{"type": "text", "text": "b" * 4}]}]}) == 3


def test_output_comes_from_max_tokens_else_the_observed_mean_else_a_default():
    assert output_tokens({"max_tokens": 7}, 30.0) == 7
    assert output_tokens({"max_completion_tokens": 9}, 30.0) == 9
    assert output_tokens({}, 30.0) == 30.0
    assert output_tokens({}, None) == DEFAULT_OUTPUT_TOKENS


def test_without_a_cost_model_a_request_is_one_unit_and_a_classic_one_costs_gamma_over_c():
    assert request_units({"prompt": "x" * 4000}, None, None) == 1.0
    assert request_units(None, COST, None) == pytest.approx(30.0 / 4)


def test_profiles_are_read_at_their_target_concurrency_and_malformed_ones_ignored():
    level = {"alpha_ms_per_input_token": 1.0, "beta_ms_per_output_token": 2.0, "gamma_ms": 3.0}
    model = {"target_concurrency": 8, "levels": [level | {"concurrency": 4, "gamma_ms": 9.0}, level | {"concurrency": 8}]}
    assert RouteCost.from_profile(model) == RouteCost(1.0, 2.0, 3.0, 8)
    assert RouteCost.from_profile({"levels": []}) is None
    assert RouteCost.from_profile({"target_concurrency": 4, "levels": [level | {"concurrency": 8}]}) is None


def test_the_mean_output_moves_a_tenth_of_the_way_to_each_new_answer():
    assert updated_mean(None, 50) == 50
    assert updated_mean(50, 150) == pytest.approx(60)
