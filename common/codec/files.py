"""Messages kept on disk: decode a whole file, or index the tensor map inside one.

``unpack_file`` decodes a whole file; ``index_tensors`` indexes the tensor map
inside one (a ClientUpdate's ``weights``) and returns a ``TensorFile`` that reads
one tensor per access, so a tensor-major fold over many large updates holds one
tensor per client at a time, never a whole update::

    file:  {"v": 1, ..., "num_examples": 10, "weights": {"a": <ext>, "b": <ext>}}
            '- msgpack: decoded, dropped -'             '- headers read here --'
    index: name -> (payload offset, length, dtype, shape); tensor data is never read
    tf["a"]: open, check the file is unchanged, read a's payload, view it (no copy)
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator, Mapping
from typing import IO, TYPE_CHECKING, Any, ClassVar, NamedTuple

import msgpack

from fedmq.common.codec.pack import DEFAULT_MAX_BYTES, FIXEXT, UNPACK_ERRORS, unpack_options, unpackb
from fedmq.common.codec.readahead import read_column
from fedmq.common.codec.tensors import (
    TENSOR_EXT,
    data_offset,
    header_end,
    tensor_from_data,
    tensor_from_payload,
    tensor_header,
)
from fedmq.common.errors import DecodeError

if TYPE_CHECKING:
    import torch

_SCAN_READ_SIZE = 16 * 1024  # msgpack's read-ahead while walking the small values of a file
# Header bytes of the msgpack formats index_tensors reads itself: marker -> width of the length field.
_MAP_LENGTHS = {0xDE: 2, 0xDF: 4}
_STR_LENGTHS = {0xD9: 1, 0xDA: 2, 0xDB: 4}
_EXT_LENGTHS = {0xC7: 1, 0xC8: 2, 0xC9: 4}
_FIXEXT_SIZES = {marker: size for size, marker in FIXEXT.items()}


def unpack_file(path: str | os.PathLike[str], *, max_bytes: int = DEFAULT_MAX_BYTES) -> Any:
    """Decode a file holding one msgpack object, exactly as unpackb would decode its bytes.

    For small messages kept on disk: the whole file is read once. A file larger
    than max_bytes raises DecodeError before any read; OSError (missing file,
    no permission) is not a decode failure and propagates.
    """
    with open(path, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        if size > max_bytes:
            raise DecodeError(f"file of {size} bytes exceeds limit of {max_bytes}")
        data = file.read(size + 1)  # one byte more than stat said, so unpackb sees a file that grew
    return unpackb(data, max_bytes=max_bytes)


def index_tensors(
    path: str | os.PathLike[str],
    key: str = "weights",
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    lazy: tuple[str, ...] = (),
) -> TensorFile:
    """Index the str -> tensor map under `key` in a file holding one msgpack map, reading no tensor data.

    The file is checked as unpackb would check it (framing, the types and
    limits of every other value, trailing bytes), except that the tensor data
    is not read, so a bool tensor holding bytes other than 0 and 1 is only
    refused when it is accessed. Other top-level values are decoded one at a
    time and dropped. Raises DecodeError for a malformed or truncated file, a
    missing key, a value under it that is not a map of str -> tensor, or a file
    over max_bytes; OSError from opening the file propagates. Tensor maps under the `lazy` keys
    (a ClientUpdate's ``extras``) are indexed the same way, into `TensorFile.maps`, not decoded.
    """
    with open(path, "rb") as file:
        before = os.fstat(file.fileno())
        if before.st_size > max_bytes:
            raise DecodeError(f"file of {before.st_size} bytes exceeds limit of {max_bytes}")
        scanner = _MapScanner(file, before.st_size)
        entries = scanner.tensors(key, lazy)
        if _identity(os.fstat(file.fileno())) != _identity(before):
            raise DecodeError(f"{os.fspath(path)!r} changed while it was indexed")
    identity = _identity(before)
    maps = {name: TensorFile(path, found, identity) for name, found in scanner.maps.items()}
    return TensorFile(path, entries, identity, scanner.fields, maps)


class TensorFile(Mapping[str, "torch.Tensor"]):
    """Tensors of a map inside a msgpack file, read one at a time on access; built by index_tensors.

    It keeps the path and an index, never an open file, so there is nothing to
    close and threads may read at once. Each access opens the file, checks it is
    the file indexed (device, inode, size, mtime), reads that tensor's payload
    with one read into a fresh buffer and views it without a further copy: the
    tensor owns its memory, so writing to it is safe and leaves the file alone,
    and it is freed when dropped. Iteration follows file order; `in`, len() and
    meta() read nothing. Access raises KeyError for an unknown name, DecodeError
    for a file changed since indexing or bad tensor data, OSError if it cannot
    be opened.

    For a fold over many files (the aggregator's kernels.WeightedMean): `owned_reads`, each
    access is a new tensor the reader may write to; `read_column`, one tensor of each file in
    order, large ones read ahead on other threads (codec.readahead).
    """

    owned_reads: ClassVar[bool] = True
    read_column = staticmethod(read_column)

    def __init__(
        self,
        path: str | os.PathLike[str],
        entries: dict[str, _Entry],
        identity: tuple[int, ...],
        fields: dict[str | int, Any] | None = None,
        maps: dict[str, TensorFile] | None = None,
    ) -> None:
        self.fields = fields or {}  # the file's other top-level values, decoded
        self.maps = maps or {}  # the other tensor maps asked for by index_tensors(lazy=...), by key
        self._path = os.fspath(path)
        self._entries = entries
        self._identity = identity

    @property
    def path(self) -> str:
        """The file the tensors are read from."""
        return self._path

    def meta(self, name: str) -> tuple[torch.dtype, torch.Size]:
        """dtype and shape of a tensor, from the index: nothing is read."""
        import torch

        entry = self._entries[name]
        return entry.dtype, torch.Size(entry.shape)

    def __getitem__(self, name: str) -> torch.Tensor:
        entry = self._entries[name]
        tensor = tensor_from_payload(self._read(entry.offset, entry.size))
        if tensor.dtype != entry.dtype or tuple(tensor.shape) != entry.shape:
            raise DecodeError(f"tensor {name!r} in {self._path!r} changed since it was indexed")
        return tensor

    def row(self, name: str, index: int) -> torch.Tensor:
        """Row `index` (along the first dimension) of a tensor, read alone: a fresh tensor, as any
        access gives; a fused group's member is one row of each of its stacked tensors."""
        entry = self._entries[name]
        if not entry.shape or not 0 <= index < entry.shape[0]:
            raise IndexError(f"tensor {name!r} {list(entry.shape)} has no row {index}")
        shape = entry.shape[1:]
        size = math.prod(shape) * entry.dtype.itemsize
        start = entry.offset + data_offset(len(entry.shape)) + index * size
        return tensor_from_data(self._read(start, size), 0, entry.dtype, shape)

    def __contains__(self, name: object) -> bool:
        return name in self._entries  # Mapping's default would read the tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"TensorFile({self._path!r}, {len(self._entries)} tensors)"

    def _read(self, offset: int, size: int) -> memoryview:
        """Read size bytes at offset from the indexed file into a new, writable buffer. It is not
        cleared first, as a bytearray is: that pass, with the faults of fresh pages, took longer
        than the read itself on a 16.7 MB tensor (10 ms against 4-6 ms, 2 cores)."""
        import numpy as np

        with open(self._path, "rb", buffering=0) as file:
            if _identity(os.fstat(file.fileno())) != self._identity:
                raise DecodeError(f"{self._path!r} changed since it was indexed")
            file.seek(offset)
            buffer = memoryview(np.empty(size, np.uint8).data)  # 16-byte aligned, as tensor data needs
            done = 0
            while done < size:  # one read, unless the OS caps it (Linux: just under 2 GiB)
                count = file.readinto(buffer[done:])
                if not count:
                    raise DecodeError(f"{self._path!r} ended at byte {offset + done} while reading")
                done += count
        return buffer


class _Entry(NamedTuple):
    """Where one tensor's ext payload lies in a file, and what it holds."""

    offset: int
    size: int
    dtype: torch.dtype
    shape: tuple[int, ...]


class _MapScanner:
    """Walks the top-level msgpack map of a file, indexing the tensor map under one key.

    Why two parsers: msgpack's Unpacker decodes the keys and the other values
    (with unpackb's hooks and limits, so they are checked alike) but would have
    to buffer each tensor ext whole just to skip it, reading all the data. So the
    tensor map is read here instead: its few header formats (map, str, ext) are
    simple, and only their headers and each tensor's header are read, then the
    data is seeked over. Indexing reads O(tensors) bytes, not O(file).
    """

    def __init__(self, file: IO[bytes], size: int) -> None:
        self._file = file
        self._size = size

    def tensors(self, key: str, lazy: tuple[str, ...] = ()) -> dict[str, _Entry]:
        """Index the map under key (and those under `lazy`), checking the whole top-level map."""
        found: dict[str, _Entry] | None = None
        self.fields: dict[str | int, Any] = {}
        self.maps: dict[str, dict[str, _Entry]] = {}
        seen: set[str | int] = set()
        base, unpacker = 0, self._unpacker(0)
        try:
            for _ in range(unpacker.read_map_header()):
                name = unpacker.unpack()
                if type(name) is not str and type(name) is not int:
                    raise DecodeError(f"map key of type {type(name).__name__} (str or int only)")
                if name in seen:
                    raise DecodeError("map has duplicate keys")
                seen.add(name)
                if name == key:
                    found, base = self._tensor_map(base + unpacker.tell(), key)
                    unpacker = self._unpacker(base)
                elif name in lazy:
                    self.maps[str(name)], base = self._tensor_map(base + unpacker.tell(), str(name))
                    unpacker = self._unpacker(base)
                else:
                    value = unpacker.unpack()
                    if type(value) is msgpack.Timestamp:
                        raise DecodeError("msgpack timestamp ext is not a fedmq type")
                    self.fields[name] = value
            end = base + unpacker.tell()
        except DecodeError:
            raise
        except UNPACK_ERRORS as exc:
            raise DecodeError(f"malformed msgpack: {type(exc).__name__}: {exc}") from exc
        if end != self._size:
            raise DecodeError(f"malformed msgpack: {self._size - end} bytes after the top-level map")
        if found is None:
            raise DecodeError(f"no {key!r} in the top-level map")
        return found

    def _unpacker(self, offset: int) -> msgpack.Unpacker:
        """A msgpack Unpacker reading the file from offset; it holds at most one value at a time."""
        self._file.seek(offset)
        return msgpack.Unpacker(
            self._file,
            read_size=max(1, min(_SCAN_READ_SIZE, self._size)),
            max_buffer_size=max(1, self._size),
            **unpack_options(self._size),
        )

    def _tensor_map(self, pos: int, key: str) -> tuple[dict[str, _Entry], int]:
        """Index the str -> tensor ext map at pos; return the entries and the offset after the map."""
        marker = self._read(pos, 1)[0]
        if 0x80 <= marker <= 0x8F:
            count, pos = marker & 0x0F, pos + 1
        elif marker in _MAP_LENGTHS:
            count, pos = self._length(pos + 1, _MAP_LENGTHS[marker])
        else:
            raise DecodeError(f"{key!r} must be a map of str -> tensor, got msgpack marker 0x{marker:02x}")
        if count * 4 > self._size - pos:  # each entry takes at least 4 bytes: "" and a fixext 1
            raise DecodeError(f"{key!r} map claims {count} entries, more than the file holds")
        entries: dict[str, _Entry] = {}
        for _ in range(count):
            name, pos = self._name(pos, key)
            if name in entries:
                raise DecodeError(f"{key!r} map has duplicate name {name!r}")
            size, pos = self._tensor_ext(pos, name)
            fixed = self._read(pos, min(8, size))
            start = header_end(fixed, size)
            dtype, shape = tensor_header(fixed + self._read(pos + 8, start - 8), size)
            entries[name] = _Entry(pos, size, dtype, shape)
            pos += size
        return entries, pos

    def _name(self, pos: int, key: str) -> tuple[str, int]:
        """Read the msgpack str at pos."""
        marker = self._read(pos, 1)[0]
        if 0xA0 <= marker <= 0xBF:
            size, pos = marker & 0x1F, pos + 1
        elif marker in _STR_LENGTHS:
            size, pos = self._length(pos + 1, _STR_LENGTHS[marker])
        else:
            raise DecodeError(f"{key!r} map has a name that is not a str (msgpack marker 0x{marker:02x})")
        try:
            return self._read(pos, size).decode(), pos + size
        except UnicodeDecodeError as exc:
            raise DecodeError(f"{key!r} map has a name that is not UTF-8: {exc}") from exc

    def _tensor_ext(self, pos: int, name: str) -> tuple[int, int]:
        """Read the header of the tensor ext at pos; return its payload size and offset."""
        marker = self._read(pos, 1)[0]
        if marker in _FIXEXT_SIZES:
            size, pos = _FIXEXT_SIZES[marker], pos + 1
        elif marker in _EXT_LENGTHS:
            size, pos = self._length(pos + 1, _EXT_LENGTHS[marker])
        else:
            raise DecodeError(f"value of {name!r} is not a tensor (msgpack marker 0x{marker:02x})")
        code = int.from_bytes(self._read(pos, 1), "big", signed=True)
        if code != TENSOR_EXT:
            raise DecodeError(f"value of {name!r} is msgpack ext type {code}, not a tensor")
        if size > self._size - pos - 1:
            raise DecodeError(f"tensor {name!r} needs {size} bytes, the file ends first")
        return size, pos + 1

    def _length(self, pos: int, width: int) -> tuple[int, int]:
        """Read a big-endian unsigned length field of width bytes."""
        return int.from_bytes(self._read(pos, width), "big"), pos + width

    def _read(self, pos: int, size: int) -> bytes:
        """Read exactly size bytes at pos, refusing reads past the end before allocating."""
        if size > self._size - pos:
            raise DecodeError(f"malformed msgpack: file truncated at byte {self._size}, needs {pos + size}")
        self._file.seek(pos)
        data = self._file.read(size)
        if len(data) != size:
            raise DecodeError(f"file ended at byte {pos + len(data)} while reading")
        return data


def _identity(stat: os.stat_result) -> tuple[int, ...]:
    """What tells a file apart from a replaced or rewritten one."""
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns
