"""pass@k (unbiased estimator) and answer extraction for maj@k, by hand."""

from math import comb

import pytest

from posttrain.evaluate import final_answer, pass_at_k


def test_pass_at_k_by_hand():
    assert pass_at_k(4, 0, 1) == 0.0
    assert pass_at_k(4, 1, 1) == pytest.approx(0.25)
    assert pass_at_k(4, 1, 2) == pytest.approx(1 - comb(3, 2) / comb(4, 2))  # 0.5
    assert pass_at_k(4, 3, 2) == 1.0  # any 2 of 4 include a correct one
    assert pass_at_k(10, 10, 5) == 1.0


def test_final_answer():
    assert final_answer(r"so \boxed{\frac{1}{2}} ok") == r"\frac{1}{2}"
    assert final_answer("The answer is 42.") == "42"
    assert final_answer("no digits") is None
