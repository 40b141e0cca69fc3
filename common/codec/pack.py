"""The msgpack layer: packb and unpackb, with torch tensors as an explicit extension type.

Never pickle: every decoded byte is checked and anything malformed raises
``DecodeError``. torch is imported only when a tensor is met, so the control
plane can use this module without it. Tuples come back as lists; map keys must
be str or int. The tensor ext's payload is laid out and checked in
``fedmq.common.codec.tensors``.

Decoded tensors are read-only views of the bytes msgpack hands the ext hook, so
decoding costs one copy of the data; clone a tensor before writing to it in place.
"""

from __future__ import annotations

import struct
import sys
from typing import TYPE_CHECKING, Any

import msgpack

from fedmq.common.codec.tensors import TENSOR_EXT, tensor_from_payload, tensor_parts
from fedmq.common.errors import DecodeError

if TYPE_CHECKING:
    import torch

DEFAULT_MAX_BYTES: int = 2 * 1024**3
FIXEXT = {1: 0xD4, 2: 0xD5, 4: 0xD6, 8: 0xD7, 16: 0xD8}  # payload size -> msgpack fixext marker
UNPACK_ERRORS = (msgpack.UnpackException, ValueError, TypeError, OverflowError, RecursionError)
_MAX_DEPTH = 512  # msgpack cannot unpack much deeper nesting, so refuse to pack it
_FLAT_TYPES = frozenset({type(None), bool, int, float, str, bytes})


class Encoded:
    """An encoding as the parts it is made of, in order: tensor data is viewed, not copied.

    A large message can be sent chunk by chunk from these parts without ever being joined
    into one buffer. The views read the tensors as they are when read: change no tensor
    until the parts have been sent (or joined).
    """

    def __init__(self, parts: list[bytes | memoryview], owned: bool = False) -> None:
        """`owned`: nothing changes the viewed tensors any more (they are this encoding's alone),
        so a bus may read the parts after publish returns (the in-memory bus, on its consumer's
        thread), not only while publishing."""
        self.parts = parts
        self.owned = owned
        self.size = sum(part.nbytes if isinstance(part, memoryview) else len(part) for part in parts)

    def join(self) -> bytes:
        """The whole encoding in one bytes object (copies the tensor data once)."""
        only = self.parts[0] if len(self.parts) == 1 else None
        return only if isinstance(only, bytes) else b"".join(self.parts)


def packb(obj: Any) -> bytes:
    """Encode obj as msgpack; a tensor anywhere in its dicts, lists or tuples becomes a tensor ext.

    Raises TypeError for objects msgpack cannot represent and for map keys that
    are not str or int. Tensor data is copied once, into the returned bytes.
    """
    return packb_parts(obj).join()


def packb_parts(obj: Any) -> Encoded:
    """packb's encoding, not joined: the parts refer to the tensors' data (see Encoded)."""
    # If torch was never imported no tensor can exist, so the control plane never pays for it.
    tensor_type = getattr(sys.modules.get("torch"), "Tensor", None)
    writer = _Writer(tensor_type)
    writer.write(obj, 0)
    return writer.finish()


def unpackb(data: bytes | bytearray | memoryview, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Any:
    """Decode one msgpack object made by packb; anything malformed raises DecodeError."""
    view = _checked_view(data, max_bytes)
    try:
        obj = msgpack.unpackb(view, **unpack_options(view.nbytes))
    except DecodeError:
        raise
    except UNPACK_ERRORS as exc:
        raise DecodeError(f"malformed msgpack: {type(exc).__name__}: {exc}") from exc
    if type(obj) is msgpack.Timestamp:
        raise DecodeError("msgpack timestamp ext is not a fedmq type")
    return obj


def unpack_options(size: int) -> dict[str, Any]:
    """msgpack options for decoding input of size bytes: fedmq's types, checked, with size limits."""
    return {
        "use_list": True,  # arrays are lists, so tuples come back as lists (documented above)
        "raw": False,  # str must be valid UTF-8; bin stays bytes
        "strict_map_key": False,  # msgpack's strict mode allows bytes keys but not int; we check
        "object_pairs_hook": _checked_dict,
        "list_hook": _checked_list,
        "ext_hook": _ext_to_object,
        # No container or string can claim more items or bytes than the input holds.
        "max_str_len": size,
        "max_bin_len": size,
        "max_ext_len": size,
        "max_array_len": size,
        "max_map_len": size // 2,
    }


class _Writer:
    """Collects encoded chunks; tensor data is kept by reference, so one join (if any) copies it."""

    def __init__(self, tensor_type: type[torch.Tensor] | None) -> None:
        self._tensor_type = tensor_type
        self._packer = msgpack.Packer(use_bin_type=True, autoreset=False)
        self._chunks: list[bytes | memoryview] = []

    def write(self, obj: Any, depth: int) -> None:
        """Append obj, walking containers so tensors and map keys can be handled."""
        if depth > _MAX_DEPTH:
            raise ValueError(f"nesting deeper than {_MAX_DEPTH} levels")
        packer = self._packer
        if isinstance(obj, dict):
            if all(type(key) is str for key in obj) and all(type(v) in _FLAT_TYPES for v in obj.values()):
                packer.pack(obj)  # a map of plain values under str keys: msgpack's C loop, as for lists
                return
            packer.pack_map_header(len(obj))
            for key, value in obj.items():
                if not isinstance(key, str | int) or isinstance(key, bool):
                    raise TypeError(f"map keys must be str or int, not {type(key).__name__}")
                packer.pack(key)
                if type(value) in _FLAT_TYPES:
                    packer.pack(value)  # nothing to walk (a spec is mostly these): no call per value
                else:
                    self.write(value, depth + 1)
        elif isinstance(obj, list | tuple):
            if all(type(item) in _FLAT_TYPES for item in obj):
                packer.pack(obj)  # nothing to walk: let msgpack's C loop do it
            else:
                packer.pack_array_header(len(obj))
                for item in obj:
                    self.write(item, depth + 1)
        elif self._tensor_type is not None and isinstance(obj, self._tensor_type):
            header, data = tensor_parts(obj)
            prefix = _ext_prefix(len(header) + data.nbytes)
            self._chunks += [packer.bytes(), prefix, header, data]
            packer.reset()
        else:
            packer.pack(obj)

    def finish(self) -> Encoded:
        """Everything written, as parts in order."""
        return Encoded([*self._chunks, self._packer.bytes()])


def _ext_prefix(size: int) -> bytes:
    """Return the msgpack ext header (format byte, length, type) for a tensor payload."""
    if size in FIXEXT:
        return bytes((FIXEXT[size], TENSOR_EXT))
    if size <= 0xFF:
        return struct.pack(">BBb", 0xC7, size, TENSOR_EXT)
    if size <= 0xFFFF:
        return struct.pack(">BHb", 0xC8, size, TENSOR_EXT)
    if size <= 0xFFFFFFFF:
        return struct.pack(">BIb", 0xC9, size, TENSOR_EXT)
    raise ValueError(f"tensor payload of {size} bytes exceeds msgpack's 4 GiB ext limit")


def _ext_to_object(code: int, payload: bytes) -> Any:
    """msgpack ext hook: only tensors are known."""
    if code != TENSOR_EXT:
        raise DecodeError(f"unknown msgpack ext type {code}")
    return tensor_from_payload(payload)


def _checked_dict(pairs: list[tuple[Any, Any]]) -> dict[Any, Any]:
    """msgpack map hook: keys are str or int, unique, and no value is a timestamp."""
    result = {}
    for key, value in pairs:
        if type(key) is not str and type(key) is not int:
            raise DecodeError(f"map key of type {type(key).__name__} (str or int only)")
        if type(value) is msgpack.Timestamp:
            raise DecodeError("msgpack timestamp ext is not a fedmq type")
        result[key] = value
    if len(result) != len(pairs):
        raise DecodeError("map has duplicate keys")
    return result


def _checked_list(items: list[Any]) -> list[Any]:
    """msgpack array hook: timestamps (ext -1) bypass ext_hook, so refuse them here."""
    if msgpack.Timestamp in map(type, items):
        raise DecodeError("msgpack timestamp ext is not a fedmq type")
    return items


def _checked_view(data: object, max_bytes: int) -> memoryview:
    """Return data as a flat byte view, refusing non-bytes and inputs over max_bytes."""
    if not isinstance(data, bytes | bytearray | memoryview):
        raise DecodeError(f"expected bytes, got {type(data).__name__}")
    try:
        view = memoryview(data)
        if view.nbytes > max_bytes:
            raise DecodeError(f"input of {view.nbytes} bytes exceeds limit of {max_bytes}")
        return view if view.format == "B" and view.ndim == 1 else view.cast("B")
    except (ValueError, TypeError) as exc:  # released or non-contiguous memoryview
        raise DecodeError(f"unreadable buffer: {exc}") from exc
