"""CPU checks of the GPU kernel suite itself: every op of the seam has a device test case, and
the comparison harness is exact when the reference is compared with itself."""

from __future__ import annotations

import pytest
import torch
from kernel_cases import CASES, compare, registered_ops


def test_every_registered_op_has_a_gpu_case():
    missing = sorted(set(registered_ops()) - set(CASES))
    assert not missing, (
        f"kernel ops {missing} have no case in tests/gpu/kernel_cases.py CASES: add a small "
        "seeded input builder so the op is compared with its torch reference on GPUs"
    )


def test_no_case_for_an_op_that_is_not_registered():
    stale = sorted(set(CASES) - set(registered_ops()))
    assert not stale, f"CASES names ops the kernel seam does not register: {stale}"


@pytest.mark.parametrize("op", sorted(CASES))
def test_harness_is_exact_for_the_reference(op):
    # Same backend, device and dtype as the reference: any nonzero error is a harness bug.
    errors = compare(op, "torch", torch.device("cpu"), torch.float32)
    assert all(e == 0.0 for e in errors.values()), errors
