"""Client state sealed by the learners: the aggregator keeps it, and can neither read nor change it.

A job whose clients keep state (`personalize`, `train.keep_optimizer_state`, a Task's
`keeps_state`) sends each client's state with its update to the aggregator, which keeps it durable
and hands it back with the client's next task, whichever learner takes it. With FEDMQ_STATE_KEY
set on the learners (the same on every learner, never on the aggregator or the scheduler), a
learner seals it first:

    entries (state.py's)  ─packb─▶  AES-256-GCM(key, random 96-bit nonce, bound to job and client)
                          ─▶  one entry `fedmq.state.s.sealed`: nonce ‖ ciphertext ‖ tag, uint8

The key is HKDF-SHA256 of the secret. The aggregator checks only the sealed entry's form and size
(state.check_state_entries); the learner that trains the client next opens it, and refuses one
changed on the way, moved to another client or job, or sealed under another key. The engine
(`fedmq run`) keeps state in its own memory and seals nothing. Sealing changes no result: the
same state comes back, bit for bit.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

import torch
from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from fedmq.common.codec.pack import packb, unpackb
from fedmq.common.codec.updates import STATE
from fedmq.common.errors import DecodeError, FedmqError

SEALED = f"{STATE}s.sealed"  # the one entry a sealed client state is
NONCE_BYTES = 12
_INFO = b"fedmq client state v1"


class StateSealError(FedmqError):
    """A client's sealed state could not be opened here; the message says why and what to do."""


class StateSealer:
    """Seals and opens client state with the learners' FEDMQ_STATE_KEY."""

    def __init__(self, secret: str) -> None:
        key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_INFO).derive(secret.encode())
        self._aead = AESGCM(key)

    def seal(self, entries: Mapping[str, torch.Tensor], job_id: str, client: int) -> dict[str, torch.Tensor]:
        """`entries` as the one sealed entry."""
        nonce = os.urandom(NONCE_BYTES)
        sealed = nonce + self._aead.encrypt(nonce, packb(dict(entries)), _bound(job_id, client))
        return {SEALED: torch.frombuffer(bytearray(sealed), dtype=torch.uint8)}

    def open(self, stored: Mapping[str, torch.Tensor], job_id: str, client: int) -> dict[str, torch.Tensor]:
        """`stored` with its sealed entry, if any, replaced by the entries it holds (owned tensors)."""
        if SEALED not in stored:
            return dict(stored)
        blob = stored[SEALED].numpy().tobytes()
        try:
            plain = self._aead.decrypt(blob[:NONCE_BYTES], blob[NONCE_BYTES:], _bound(job_id, client))
            entries = unpackb(plain, max_bytes=len(plain) + 1)
        except (InvalidTag, ValueError, DecodeError):
            raise StateSealError(
                f"client {client}'s state does not open with this learner's FEDMQ_STATE_KEY: another key "
                "sealed it (give every learner the same), or it was changed on its way") from None
        if not isinstance(entries, dict) or not all(isinstance(v, torch.Tensor) for v in entries.values()):
            raise StateSealError(f"client {client}'s sealed state holds no tensor entries")
        others = {k: v for k, v in stored.items() if k != SEALED}
        return others | {str(k): v.clone() for k, v in entries.items()}


def still_sealed(stored: Mapping[str, torch.Tensor], client: int) -> None:
    """StateSealError when a process without the key (a learner, a Result's reader) gets sealed state."""
    if SEALED in stored:
        raise StateSealError(
            f"client {client}'s state is sealed and this process has no FEDMQ_STATE_KEY: give it the key "
            "the learners have")


def _bound(job_id: str, client: int) -> bytes:
    """The associated data: a blob opens only for the job and client it was sealed for."""
    return f"fedmq.state\0{job_id}\0{client}".encode()
