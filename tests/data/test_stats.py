"""Unigram entropy: log V for uniform tokens, 0 for one repeated token, and the textbook value in between."""

from __future__ import annotations

import math

import numpy as np

from jaxscale.data import unigram_entropy_nats


def test_unigram_entropy_of_known_distributions():
    assert math.isclose(unigram_entropy_nats(np.arange(256).repeat(3), 256), math.log(256))
    assert unigram_entropy_nats(np.full(100, 7), 256) == 0.0
    tokens = np.array([0, 0, 0, 1])  # p = 3/4, 1/4
    expected = -(0.75 * math.log(0.75) + 0.25 * math.log(0.25))
    assert math.isclose(unigram_entropy_nats(tokens, 2), expected)
    assert math.isclose(unigram_entropy_nats(np.tile(tokens, 5), 2, chunk=3), expected)  # chunked reading agrees
