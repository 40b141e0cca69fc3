"""Client state sealed by the learners (common/task/sealing.py): what the aggregator keeps is opaque,
comes back bit for bit, and opens only with the learners' key, for its own job and client."""

from __future__ import annotations

import pytest
import torch

from fedmq.common.task.sealing import SEALED, StateSealer, StateSealError, still_sealed
from fedmq.common.task.state import check_state_entries, state_entries, state_of

JOB, CLIENT = "job-1", 3


def entries() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return state_entries({"personal.3.weight": torch.randn(10, 4, generator=gen), "visits": 4, "lr": 0.25,
                          "warm": True, "half": torch.randn(3, generator=gen).half()})


def test_sealed_state_is_one_opaque_entry_that_opens_to_the_same_bits() -> None:
    sealer = StateSealer("a learners' secret")
    plain = entries()
    sealed = sealer.seal(plain, JOB, CLIENT)
    assert list(sealed) == [SEALED] and sealed[SEALED].dtype == torch.uint8 and sealed[SEALED].dim() == 1
    blob = sealed[SEALED].numpy().tobytes()
    assert plain["fedmq.state.t.personal.3.weight"].numpy().tobytes() not in blob  # no plaintext in it
    check_state_entries(sealed, limit_bytes=1 << 20)  # the aggregator's check of its form and size
    residual = {"fedmq.residual.w": torch.ones(2)}  # compression's own entries stay as they are
    opened = StateSealer("a learners' secret").open(sealed | residual, JOB, CLIENT)
    assert opened.keys() == plain.keys() | residual.keys()
    for name, tensor in plain.items():
        assert opened[name].dtype == tensor.dtype and torch.equal(opened[name], tensor), name
    opened["fedmq.state.t.personal.3.weight"].add_(1)  # owned, writable tensors
    assert state_of({k: v for k, v in opened.items() if k.startswith("fedmq.state.")})["visits"] == 4
    assert sealer.seal(plain, JOB, CLIENT)[SEALED].numpy().tobytes() != blob  # a fresh nonce each time


@pytest.mark.parametrize("change", ["key", "client", "job", "byte", "truncated"])
def test_sealed_state_opens_for_nothing_else(change: str) -> None:
    sealed = StateSealer("secret").seal(entries(), JOB, CLIENT)
    key, job, client = "secret", JOB, CLIENT
    if change == "key":
        key = "another secret"
    elif change == "client":
        client = CLIENT + 1
    elif change == "job":
        job = "job-2"
    elif change == "byte":
        sealed[SEALED][40] ^= 1
    else:
        sealed = {SEALED: sealed[SEALED][:20].clone()}
    with pytest.raises(StateSealError, match="does not open with this learner's FEDMQ_STATE_KEY"):
        StateSealer(key).open(sealed, job, client)


def test_a_learner_without_the_key_says_so_and_the_aggregator_refuses_a_malformed_seal() -> None:
    sealed = StateSealer("secret").seal(entries(), JOB, CLIENT)
    with pytest.raises(StateSealError, match="this process has no FEDMQ_STATE_KEY"):
        still_sealed(sealed, CLIENT)
    still_sealed(entries(), CLIENT)
    with pytest.raises(ValueError, match="still sealed"):
        state_of(sealed)
    for bad in ({SEALED: sealed[SEALED].float()}, {SEALED: sealed[SEALED].reshape(1, -1)},
                {**sealed, "fedmq.state.i.visits": torch.tensor(1)}, {"fedmq.state.s.other": sealed[SEALED]}):
        with pytest.raises(ValueError, match="no sealed client state"):
            check_state_entries(bad, limit_bytes=1 << 20)
    with pytest.raises(ValueError, match="over its limit"):
        check_state_entries(sealed, limit_bytes=100)


def test_state_in_the_clear_where_sealed_state_is_due_is_refused() -> None:
    sealer = StateSealer("secret of the learners")
    sealed = sealer.seal(entries(), JOB, CLIENT)
    forged = {"fedmq.state.i.visits": torch.tensor(99)}
    for stored in (forged, sealed | forged):  # the aggregator's own state, alone or slipped in beside
        with pytest.raises(StateSealError, match="in the clear"):
            sealer.open(stored, JOB, CLIENT)
    assert sealer.open({"fedmq.residual.w": torch.ones(1)}, JOB, CLIENT).keys() == {"fedmq.residual.w"}


def test_a_large_state_is_sealed_in_chunks_that_open_only_together_and_in_order(
    monkeypatch: pytest.MonkeyPatch
) -> None:
    from fedmq.common.task import sealing

    monkeypatch.setattr(sealing, "CHUNK_BYTES", 64)
    sealer = StateSealer("secret of the learners")
    plain = entries()
    blob = sealer.seal(plain, JOB, CLIENT)[SEALED]
    opened = sealer.open({SEALED: blob}, JOB, CLIENT)
    assert all(torch.equal(opened[k], v) for k, v in plain.items())
    raw = bytearray(blob.numpy().tobytes())
    size = 8 + 12 + 64 + 16  # a full chunk: its length, nonce, ciphertext and tag
    first, second = raw[8:8 + size], raw[8 + size:8 + 2 * size]
    swapped = raw[:8] + second + first + raw[8 + 2 * size:]
    dropped = raw[:8 + size] + raw[8 + 2 * size:]
    for bad in (swapped, dropped, raw + b"\0"):
        with pytest.raises(StateSealError, match="does not open"):
            sealer.open({SEALED: torch.frombuffer(bytearray(bad), dtype=torch.uint8)}, JOB, CLIENT)


def test_a_short_state_key_is_refused() -> None:
    from pydantic import ValidationError

    from fedmq.common.settings import Settings

    with pytest.raises(ValidationError, match="at least 16 characters"):
        Settings(state_key="short")
    assert Settings(state_key="").state_key is None
