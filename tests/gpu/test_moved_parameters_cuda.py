"""The per-commit address check on a CUDA arena, through PyTorch's C++ pointer comparison
(``torch._C._tensors_data_ptrs_at_indices_equal``, CUDA builds) and the ``map`` fallback: the
same cases as tests/unit/test_moved_parameters_fast.py (issue 15)."""

from __future__ import annotations

import pytest
import torch

from miserver.ipc import export
from tests.unit import test_moved_parameters_fast as cases

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

NATIVE = pytest.mark.parametrize("native", [True, False], ids=["native", "map"])


def test_the_cuda_build_has_the_native_comparison():
    assert export._pointers_equal is not None  # else the commit-end check is the map's


@NATIVE
def test_nothing_moved_cuda(native):
    cases.test_nothing_moved_and_in_place_writes_move_nothing(native, device="cuda")


@NATIVE
def test_moved_cuda(native):
    cases.test_a_rebound_or_replaced_or_removed_parameter_is_listed_as_the_full_check_lists_it(
        native, device="cuda"
    )


@NATIVE
def test_recorded_addresses_cuda(native):
    cases.test_recorded_addresses_replace_the_probe(native, device="cuda")
