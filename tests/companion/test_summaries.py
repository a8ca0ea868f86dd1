"""companion.experiments.summaries: the book's one definition of the final training loss."""
import math

import pytest

from companion.experiments.summaries import final_train_loss, final_window


@pytest.mark.parametrize("n, window", [(1, 1), (9, 1), (10, 1), (11, 2), (64, 7), (100, 10), (42_100, 4_210)])
def test_window_is_ten_percent_rounded_up_at_least_one(n, window):
    assert final_window(n) == window


def test_final_loss_is_the_mean_of_the_window_only():
    losses = [10.0] * 90 + [1.0] * 9 + [4.0]  # the last 10 of 100: nine 1s and a 4
    assert final_train_loss(losses) == pytest.approx(1.3)
    assert final_train_loss([2.5]) == 2.5


def test_bad_input_is_refused_with_the_value():
    with pytest.raises(ValueError, match="n_steps=0"):
        final_train_loss([])
    with pytest.raises(ValueError, match="diverged"):
        final_train_loss([1.0] * 20 + [math.nan])
    with pytest.raises(ValueError, match="fraction"):
        final_window(10, fraction=0)
