"""Horovod conformance: horovod.torch's contract, run the way Horovod's own tests run it
(ranks as processes on gloo, every result against a direct computation)."""
import pytest
import torch

from spawn import spawn_ranks

import conformance_fns


def _ranks(fn_name, size=2, **kwargs):
    return spawn_ranks("conformance_fns", fn_name, size, timeout=90, **kwargs)


def test_shutdown_then_init_forms_a_new_ring_while_old_objects_are_held():
    for r in _ranks("reinit_twice"):
        torch.testing.assert_close(r["first"], torch.full((3,), 2.0))
        torch.testing.assert_close(r["second"], torch.full((3,), 3.0))
        assert r["third"].tolist() == [0, 1]


@pytest.mark.parametrize("size", [2, 3])
def test_every_dtype_horovod_supports_matches_a_direct_computation(size):
    results = _ranks("every_dtype_against_a_direct_computation", size)
    for r in results:
        assert set(r) == {str(d) for d in conformance_fns.DTYPES}
        for dtype, ops in r.items():
            for op, (got, expected) in ops.items():
                assert got.dtype == expected.dtype, (dtype, op)
                assert torch.equal(got, expected), (dtype, op, got, expected)


def test_integer_average_truncates_toward_zero_and_scaling_keeps_the_dtype():
    for r in _ranks("integer_average_and_scaling"):
        assert r["avg"].tolist() == [-4, 4, 10, -10] and r["avg"].dtype == torch.int32
        assert r["pre"].tolist() == [-4, 4, 10, -10]      # trunc(-1.5) + trunc(-3.0) = -1 - 3
        assert r["post"].tolist() == [-4, 4, 10, -10]
        assert r["int16"].dtype == torch.int16 and r["int16"].tolist() == [-9, 9, 21, -21]
