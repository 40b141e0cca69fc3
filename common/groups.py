"""Clients trained together travel as one GroupUpdate; the aggregator reads it as their ClientUpdates.

    learner:    ClientUpdate × G ─▶ group_of ─▶ GroupUpdate{members[0..G), weights{name: [G, *shape]}}
    aggregator: GroupUpdate ─▶ members ─▶ ClientUpdate(member i, weights{name: weights[name][i]}) × G

The group's model fetch (its time and bytes) is its first member's: a round counts it once.

Each member's update is then checked and counted as if it had come alone: the same checks, the
same exactly-once rule (a member already stored, its task trained again after a crash in another
group, changes nothing). The group saves the per-message costs: encoding, the broker, decoding,
one file for the group (services/aggregator/grouped.py), the scheduler's bookkeeping.
"""

from __future__ import annotations

import torch

from fedmq.common.errors import ValidationError
from fedmq.common.finite import finite_by_row
from fedmq.common.messages import ClientUpdate, GroupMember, GroupUpdate


def members(group: GroupUpdate) -> list[ClientUpdate]:
    """The member updates, in the group's order; ValidationError if its tensors do not split so."""
    count = len(group.members)
    clients = [m.client for m in group.members]
    if len(set(clients)) != count:
        raise ValidationError("unknown_client", "a client appears twice in one group")
    for name, stacked in group.weights.items():
        if not isinstance(stacked, torch.Tensor) or stacked.dim() == 0 or stacked.shape[0] != count:
            raise ValidationError("wrong_shape", f"{name} must stack one row per member ({count})")
    return [
        ClientUpdate(
            job_id=group.job_id, task_id=member.task_id, round=group.round, client=member.client,
            base_digest=group.base_digest, num_examples=member.num_examples, metrics=member.metrics,
            train_seconds=member.train_seconds, fetch_seconds=group.fetch_seconds if i == 0 else 0.0,
            fetch_bytes=group.fetch_bytes if i == 0 else 0, learner=group.learner,
            weights={name: stacked[i] for name, stacked in group.weights.items()},
        )
        for i, member in enumerate(group.members)
    ]


def finite_rows(group: GroupUpdate) -> list[bool]:
    """For each member, whether every floating value of its weights is finite: one check per
    stacked tensor, not one per member and tensor (call after `members`, which checks the shapes)."""
    finite = torch.ones(len(group.members), dtype=torch.bool)
    try:
        for stacked in group.weights.values():
            if stacked.is_floating_point():
                finite &= finite_by_row(stacked)
    except (RuntimeError, NotImplementedError, TypeError):  # a dtype isfinite cannot take (float8):
        return [False] * len(group.members)  # each member is checked alone, and refused for its dtype
    return [bool(ok) for ok in finite.tolist()]


def group_of(updates: list[ClientUpdate]) -> GroupUpdate:
    """The one message for `updates` (of one job, round and base model; uncompressed, no extras)."""
    first = updates[0]
    return GroupUpdate(
        job_id=first.job_id, round=first.round, base_digest=first.base_digest,
        fetch_seconds=sum(u.fetch_seconds for u in updates), fetch_bytes=sum(u.fetch_bytes for u in updates),
        learner=first.learner,
        members=[GroupMember(task_id=u.task_id, client=u.client, num_examples=u.num_examples,
                             metrics=u.metrics, train_seconds=u.train_seconds) for u in updates],
        weights={name: torch.stack([u.weights[name] for u in updates]) for name in first.weights},
    )


def groupable(update: ClientUpdate) -> bool:
    """Whether an update may travel in a group: plain weights, nothing beside them."""
    return update.compression is None and not update.delta and not update.extras
