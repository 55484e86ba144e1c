"""Every other family of `models.FAMILIES` from the second (`families.py` has the checks), compiled through
torch.export, against transformers. The table is split over two files so that pytest-xdist's workers share it."""

from __future__ import annotations

import pytest
from families import (
    check_batched_equals_solo,
    check_decode_across_the_window,
    check_greedy,
    check_prefill,
    check_quantized_generates,
)
from models import FAMILIES

pytestmark = pytest.mark.slow
NAMES = list(FAMILIES)[1::2]  # every other family, the windowed ones spread over both files


@pytest.mark.parametrize("name", NAMES)
def test_prefill_of_three_windows_matches_transformers(tiny_models, name):
    check_prefill(tiny_models.exported(name))


@pytest.mark.parametrize("name", NAMES)
def test_decode_across_the_window_matches_transformers(tiny_models, name):
    check_decode_across_the_window(tiny_models.exported(name))


@pytest.mark.parametrize("name", NAMES)
def test_greedy_tokens_equal_transformers(tiny_models, name):
    check_greedy(tiny_models.exported(name))


@pytest.mark.parametrize("name", NAMES)
def test_four_sequences_batched_equal_their_solo_runs(tiny_models, name):
    check_batched_equals_solo(tiny_models.exported(name))


@pytest.mark.parametrize("name", NAMES)
def test_q4f32_compiles_and_generates(tiny_models, name):
    check_quantized_generates(tiny_models.exported(name, "q4f32"))
