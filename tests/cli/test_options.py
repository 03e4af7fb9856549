"""cli/options.py: the argparse value types the commands share."""

from __future__ import annotations

import argparse

import pytest

from kvsched.cli.options import int_in, positive_float


def test_an_integer_in_range_is_accepted_with_or_without_underscores():
    assert int_in(1, 10)("7") == 7
    assert int_in(1, 1 << 20)("1_000") == 1000


@pytest.mark.parametrize(("text", "message"), [("0", "must be in"), ("x", "expected an integer")])
def test_an_integer_out_of_range_or_not_an_integer_is_an_argparse_error(text: str, message: str):
    with pytest.raises(argparse.ArgumentTypeError, match=message):
        int_in(1, 10)(text)


@pytest.mark.parametrize("text", ["0", "-1", "inf", "nan", "x"])
def test_a_positive_float_refuses_zero_negatives_infinities_and_words(text: str):
    with pytest.raises(argparse.ArgumentTypeError):
        positive_float(text)
    assert positive_float("0.5") == 0.5
