"""The one-reduction finiteness checks say what torch.isfinite(...).all() says."""

from __future__ import annotations

import pytest
import torch

from fedmq.common.finite import all_finite, finite_by_row


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("bad", [None, float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 1, 4), (1,)])
def test_all_finite_agrees_with_isfinite(
    dtype: torch.dtype, bad: float | None, shape: tuple[int, ...]
) -> None:
    g = torch.Generator().manual_seed(hash((str(dtype), shape)) % 2**31)
    for _ in range(5):
        t = (torch.randn(shape, generator=g) * 1e3).to(dtype)
        if bad is not None:
            t.view(-1)[int(torch.randint(t.numel(), (1,), generator=g))] = bad
        assert all_finite(t).shape == ()
        assert bool(all_finite(t)) == bool(torch.isfinite(t).all()) == (bad is None)
        rows = t.reshape(t.shape[0], -1)
        assert finite_by_row(t).tolist() == torch.isfinite(rows).all(dim=1).tolist()


def test_empty_tensors_and_rows_are_finite() -> None:
    assert bool(all_finite(torch.empty(0)))
    assert finite_by_row(torch.empty(3, 0)).tolist() == [True, True, True]


def test_a_dtype_aminmax_cannot_take_falls_back_to_isfinite() -> None:
    if not hasattr(torch, "float8_e4m3fn"):
        pytest.skip("this torch has no float8")
    t = torch.zeros(4, dtype=torch.float8_e4m3fn)
    try:
        expected = bool(torch.isfinite(t).all())
    except (RuntimeError, NotImplementedError) as exc:  # isfinite cannot either: the same error, as before
        with pytest.raises(type(exc)):
            all_finite(t)
    else:
        assert bool(all_finite(t)) == expected


def test_complex_tensors_are_checked_as_isfinite_checks_them() -> None:
    assert bool(all_finite(torch.tensor([1 + 1j, 2 + 0j])))
    assert not bool(all_finite(torch.tensor([1 + 1j, complex("nan+1j")])))
    assert not bool(all_finite(torch.tensor([complex("1+infj")])))


def test_many_tensors_are_finite_unless_one_value_is_not_even_when_their_sum_overflows() -> None:
    from fedmq.common.finite import all_finite_many

    ok = [torch.ones(3), torch.zeros(2, 2), torch.empty(0)]
    assert all_finite_many(ok) and all_finite_many([])
    for bad in (float("nan"), float("inf"), float("-inf")):
        assert not all_finite_many([*ok, torch.tensor([1.0, bad])])
    huge = torch.full((4,), torch.finfo(torch.float64).max, dtype=torch.float64)  # sums to inf, all finite
    assert all_finite_many([huge])
    squares_overflow = [torch.full((3,), 1e30), torch.ones(2)]  # float32 norms overflow, all finite
    assert all_finite_many(squares_overflow)
    assert not all_finite_many([*squares_overflow, torch.tensor([float("nan")])])


def test_many_tensors_of_mixed_dtypes_and_sizes_say_the_same_as_each_tensor_alone() -> None:
    from fedmq.common.finite import CAT_NUMEL, all_finite, all_finite_many

    one_dtype = [torch.ones(3), torch.ones(2, 2)]  # copied into one and summed
    mixed = [torch.ones(3, dtype=torch.float16) * 6e4, torch.ones(2), torch.ones(2, dtype=torch.float64)]
    large = [torch.ones(CAT_NUMEL), torch.ones(5)]  # summed one by one, not copied into one
    assert all_finite_many([*mixed, torch.ones(2).to(torch.float8_e4m3fn)])  # torch.cat cannot promote it
    for tensors in (one_dtype, mixed, large):
        assert all_finite_many(tensors)
        for i in range(len(tensors)):
            for bad in (float("nan"), float("inf")):
                broken = [t.clone() for t in tensors]
                broken[i][-1] = bad
                assert not all_finite_many(broken)
                assert all_finite_many(broken) == all(bool(all_finite(t)) for t in broken)
