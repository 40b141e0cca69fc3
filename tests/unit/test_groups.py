"""A fused group's updates in one message: split back bit for bit, or refused whole."""

from __future__ import annotations

import pytest
import torch

from fedmq.common.errors import ValidationError
from fedmq.common.groups import finite_rows, group_of, groupable, members
from fedmq.common.messages import ClientUpdate, GroupUpdate, expect, from_wire, to_wire


def update(client: int, **changes: object) -> ClientUpdate:
    gen = torch.Generator().manual_seed(client)
    fields: dict = dict(job_id="j", task_id=f"t{client}", round=3, client=client, base_digest="d",
                        num_examples=10 + client, metrics={"loss": client / 10}, train_seconds=0.5,
                        fetch_seconds=0.1, fetch_bytes=7, learner="vm/0",
                        weights={"w": torch.randn(4, 3, generator=gen), "b": torch.randn(3, generator=gen),
                                 "n": torch.tensor([client])})
    return ClientUpdate(**{**fields, **changes})


def test_a_group_read_back_from_the_wire_gives_each_member_its_own_update_bit_for_bit() -> None:
    # As a learner's group makes them: the model's fetch is its first update's (the rest found it cached).
    updates = [update(c, **({} if i == 0 else {"fetch_seconds": 0.0, "fetch_bytes": 0}))
               for i, c in enumerate((5, 2, 9))]
    back = members(expect(from_wire(to_wire(group_of(updates))), GroupUpdate))
    for sent, got in zip(updates, back, strict=True):
        assert got.model_dump(exclude={"msg_id", "sent_at", "weights"}) == sent.model_dump(
            exclude={"msg_id", "sent_at", "weights"})
        assert set(got.weights) == set(sent.weights)
        for name, tensor in sent.weights.items():
            assert got.weights[name].dtype == tensor.dtype and torch.equal(got.weights[name], tensor)
        stored = expect(from_wire(to_wire(got)), ClientUpdate)  # a row is stored as a tensor of its own
        assert torch.equal(stored.weights["w"], sent.weights["w"])


def test_a_group_that_does_not_split_into_its_members_is_refused() -> None:
    group = group_of([update(1), update(2)])
    short = group.model_copy(update={"weights": {**group.weights, "b": group.weights["b"][:1]}})
    with pytest.raises(ValidationError, match="wrong_shape"):
        members(short)
    twice = group.model_copy(update={"members": [group.members[0], group.members[0]]})
    with pytest.raises(ValidationError, match="unknown_client"):
        members(twice)


def test_only_plain_updates_travel_in_groups() -> None:
    assert groupable(update(1))
    assert not groupable(update(1, extras={"c": torch.zeros(1)}))
    assert not groupable(update(1, weights={}, delta={"w": torch.zeros(1)}, compression={"codec": "int8"}))


def test_finite_rows_names_each_member_with_a_nan_or_infinite_value_and_only_those() -> None:
    updates = [update(c) for c in (1, 2, 3, 4)]
    updates[1].weights["w"][2, 1] = float("nan")
    updates[2].weights["b"][0] = float("-inf")
    group = group_of(updates)
    assert finite_rows(group) == [True, False, False, True]
    members(group)  # the rows split as the members' own weights
    assert [bool(torch.isfinite(u.weights["w"]).all() and torch.isfinite(u.weights["b"]).all())
            for u in updates] == finite_rows(group)


def test_finite_rows_of_a_dtype_isfinite_cannot_take_leaves_each_member_to_its_own_checks() -> None:
    updates = [update(c, weights={"w": torch.zeros(2, dtype=torch.float8_e4m3fnuz)}) for c in (1, 2)]
    assert finite_rows(group_of(updates)) == [False, False]  # not an error: each is then refused alone
