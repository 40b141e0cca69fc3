"""Client state sealed by the learners: the aggregator keeps it, and can neither read nor forge it.

A job whose clients keep state (`personalize`, `train.keep_optimizer_state`, a Task's
`keeps_state`) sends each client's state with its update to the aggregator, which keeps it durable
and hands it back with the client's next task, whichever learner takes it. With FEDMQ_STATE_KEY
set on the learners (the same on every learner, never on the aggregator or the scheduler), a
learner seals it first:

    entries (state.py's)  ─packb─▶  chunks of CHUNK_BYTES, each AES-256-GCM under a random 96-bit
                          nonce, bound to job, client and its place
                          ─▶  one entry `fedmq.state.s.sealed` (uint8):
                              "FMS1" ‖ count ‖ (length ‖ nonce ‖ ciphertext and tag) per chunk

The key is HKDF-SHA256 of the secret (at least 16 characters: settings.py). The aggregator checks
only the sealed entry's form and size (state.check_state_entries); the learner that trains the
client next opens it, and refuses one changed on the way, moved to another client or job, sealed
under another key, or state in the clear where sealed state is due. What sealing does not stop:
an aggregator handing back an older sealed state of the same client and job (a rollback), or
none. The engine (`fedmq run`) keeps state in its own memory and seals nothing. Sealing changes
no result: the same state comes back, bit for bit.
"""

from __future__ import annotations

import os
import struct
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
CHUNK_BYTES = 256 * 1024 * 1024  # sealed apart: AES-GCM takes under 2 GiB a message
_INFO = b"fedmq client state v1"
_MAGIC = b"FMS1"
_HEADER = "<4sI"  # magic, number of chunks


class StateSealError(FedmqError):
    """A client's sealed state could not be opened here; the message says why and what to do."""


class StateSealer:
    """Seals and opens client state with the learners' FEDMQ_STATE_KEY."""

    def __init__(self, secret: str) -> None:
        key = HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=_INFO).derive(secret.encode())
        self._aead = AESGCM(key)

    def seal(self, entries: Mapping[str, torch.Tensor], job_id: str, client: int) -> dict[str, torch.Tensor]:
        """`entries` as the one sealed entry: CHUNK_BYTES of the packed entries at a time (AES-GCM
        takes less than 2 GiB a message), each under a nonce of its own, bound to its place."""
        plain = packb(dict(entries))
        count = max(1, -(-len(plain) // CHUNK_BYTES))
        out = bytearray(struct.pack(_HEADER, _MAGIC, count))
        for index in range(count):
            nonce = os.urandom(NONCE_BYTES)
            chunk = self._aead.encrypt(nonce, plain[index * CHUNK_BYTES:(index + 1) * CHUNK_BYTES],
                                       _bound(job_id, client, index, count))
            out += struct.pack("<Q", len(chunk)) + nonce + chunk
        return {SEALED: torch.frombuffer(out, dtype=torch.uint8)}

    def open(self, stored: Mapping[str, torch.Tensor], job_id: str, client: int) -> dict[str, torch.Tensor]:
        """`stored` with its sealed entry replaced by the entries it holds (owned tensors). A Task
        state entry stored in the clear, alone or beside the sealed one, is refused: the learners
        seal every state they send, so one in the clear was not theirs."""
        clear = sorted(k for k in stored if k.startswith(STATE) and k != SEALED)
        if clear:
            raise StateSealError(
                f"client {client}'s stored state holds entries in the clear ({', '.join(clear[:3])}) though "
                "this learner seals client state: the aggregator did not get them from a sealing learner "
                "(a job begun without FEDMQ_STATE_KEY: run it to its end, or start it again, with the key)")
        if SEALED not in stored:
            return dict(stored)
        entries = self._entries(stored[SEALED].numpy().tobytes(), job_id, client)
        others = {k: v for k, v in stored.items() if k != SEALED}
        return others | {str(k): v.clone() for k, v in entries.items()}

    def _entries(self, blob: bytes, job_id: str, client: int) -> dict[str, torch.Tensor]:
        refused = StateSealError(
            f"client {client}'s state does not open with this learner's FEDMQ_STATE_KEY: another key "
            "sealed it (give every learner the same), or it was changed on its way")
        try:
            magic, count = struct.unpack_from(_HEADER, blob)
            at, plain = struct.calcsize(_HEADER), bytearray()
            if magic != _MAGIC:
                raise refused
            for index in range(count):
                (size,) = struct.unpack_from("<Q", blob, at)
                nonce = blob[at + 8:at + 8 + NONCE_BYTES]
                chunk = blob[at + 8 + NONCE_BYTES:at + 8 + NONCE_BYTES + size]
                plain += self._aead.decrypt(nonce, chunk, _bound(job_id, client, index, count))
                at += 8 + NONCE_BYTES + size
            if at != len(blob):
                raise refused
            entries = unpackb(plain, max_bytes=len(plain) + 1)
        except (InvalidTag, ValueError, struct.error, DecodeError):
            raise refused from None
        if not isinstance(entries, dict) or not all(isinstance(v, torch.Tensor) for v in entries.values()):
            raise StateSealError(f"client {client}'s sealed state holds no tensor entries")
        return entries


def still_sealed(stored: Mapping[str, torch.Tensor], client: int) -> None:
    """StateSealError when a process without the key (a learner, a Result's reader) gets sealed state."""
    if SEALED in stored:
        raise StateSealError(
            f"client {client}'s state is sealed and this process has no FEDMQ_STATE_KEY: give it the key "
            "the learners have")


def _bound(job_id: str, client: int, index: int, count: int) -> bytes:
    """The associated data: a chunk opens only for the job, client and place it was sealed for."""
    return f"fedmq.state\0{job_id}\0{client}\0{index}\0{count}".encode()
