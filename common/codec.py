"""Msgpack codec for fedmq messages, with torch tensors as an explicit extension type.

Never pickle: every decoded byte is checked and anything malformed raises
``DecodeError``. torch is imported only when a tensor is met, so the control
plane can use this module without it. Tuples come back as lists; map keys must
be str or int.

A tensor is a msgpack ext of type ``TENSOR_EXT`` whose payload is::

    offset      size       field (integers little-endian)
    0           1          dtype code, u8 (see _DTYPE_NAMES)
    1           1          ndim, u8, at most 64
    2           6          reserved, zero
    8           8 * ndim   dims, u64 each, outermost first
    8 + 8*ndim  0 or 8     zero padding, so the data starts at a multiple of 16
    H           n          elements in C order, little-endian; n = numel * itemsize

Decoded tensors are read-only views of the bytes msgpack hands the ext hook, so
decoding costs one copy of the data; clone a tensor before writing to it in place.

Messages kept on disk: ``unpack_file`` decodes a whole file; ``index_tensors``
indexes the tensor map inside one (a ClientUpdate's ``weights``) and returns a
``TensorFile`` that reads one tensor per access, so a tensor-major fold over many
large updates holds one tensor per client at a time, never a whole update::

    file:  {"v": 1, ..., "num_examples": 10, "weights": {"a": <ext>, "b": <ext>}}
            '- msgpack: decoded, dropped -'             '- headers read here --'
    index: name -> (payload offset, length, dtype, shape); tensor data is never read
    tf["a"]: open, check the file is unchanged, read a's payload, view it (no copy)
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import struct
import sys
import warnings
from collections.abc import Iterator, Mapping
from typing import IO, TYPE_CHECKING, Any, NamedTuple

import msgpack

from fedmq.common.errors import DecodeError

if TYPE_CHECKING:
    import torch

TENSOR_EXT: int = 1
DEFAULT_MAX_BYTES: int = 2 * 1024**3

# Wire codes: append only, never renumber. Names this torch lacks are skipped at runtime.
_DTYPE_NAMES: dict[int, str] = {
    1: "bool",
    2: "uint8",
    3: "int8",
    4: "int16",
    5: "int32",
    6: "int64",
    7: "uint16",
    8: "uint32",
    9: "uint64",
    10: "float16",
    11: "bfloat16",
    12: "float32",
    13: "float64",
    14: "complex32",
    15: "complex64",
    16: "complex128",
    17: "float8_e4m3fn",
    18: "float8_e5m2",
    19: "float8_e4m3fnuz",
    20: "float8_e5m2fnuz",
    21: "float8_e8m0fnu",
    22: "float4_e2m1fn_x2",
}
_MAX_NDIM = 64
_MAX_DIM = 2**63 - 1  # torch sizes are int64
_DATA_ALIGN = 16  # CPython bytes data is 16-aligned, so this keeps every dtype aligned
_MAX_DEPTH = 512  # msgpack cannot unpack much deeper nesting, so refuse to pack it
_LITTLE_ENDIAN = sys.byteorder == "little"
_FIXEXT = {1: 0xD4, 2: 0xD5, 4: 0xD6, 8: 0xD7, 16: 0xD8}
_FLAT_TYPES = frozenset({type(None), bool, int, float, str, bytes})
_UNPACK_ERRORS = (msgpack.UnpackException, ValueError, TypeError, OverflowError, RecursionError)
_SCAN_READ_SIZE = 16 * 1024  # msgpack's read-ahead while walking the small values of a file
# Header bytes of the msgpack formats index_tensors reads itself: marker -> width of the length field.
_MAP_LENGTHS = {0xDE: 2, 0xDF: 4}
_STR_LENGTHS = {0xD9: 1, 0xDA: 2, 0xDB: 4}
_EXT_LENGTHS = {0xC7: 1, 0xC8: 2, 0xC9: 4}
_FIXEXT_SIZES = {marker: size for size, marker in _FIXEXT.items()}


def packb(obj: Any) -> bytes:
    """Encode obj as msgpack; a tensor anywhere in its dicts, lists or tuples becomes a tensor ext.

    Raises TypeError for objects msgpack cannot represent and for map keys that
    are not str or int. Tensor data is copied once, into the returned bytes.
    """
    # If torch was never imported no tensor can exist, so the control plane never pays for it.
    tensor_type = getattr(sys.modules.get("torch"), "Tensor", None)
    writer = _Writer(tensor_type)
    writer.write(obj, 0)
    return writer.finish()


def unpackb(data: bytes | bytearray | memoryview, *, max_bytes: int = DEFAULT_MAX_BYTES) -> Any:
    """Decode one msgpack object made by packb; anything malformed raises DecodeError."""
    view = _checked_view(data, max_bytes)
    try:
        obj = msgpack.unpackb(view, **_unpack_options(view.nbytes))
    except DecodeError:
        raise
    except _UNPACK_ERRORS as exc:
        raise DecodeError(f"malformed msgpack: {type(exc).__name__}: {exc}") from exc
    if type(obj) is msgpack.Timestamp:
        raise DecodeError("msgpack timestamp ext is not a fedmq type")
    return obj


def encode_state(state: Mapping[str, torch.Tensor]) -> bytes:
    """Encode a name -> tensor mapping, such as a model's state_dict, keeping its order."""
    import torch

    for name, tensor in state.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise TypeError(f"state entries must be str -> Tensor, got {name!r} -> {type(tensor)}")
    return packb(dict(state))


def decode_state(
    data: bytes | bytearray | memoryview, *, max_bytes: int = DEFAULT_MAX_BYTES
) -> dict[str, torch.Tensor]:
    """Decode bytes from encode_state; tensors are read-only views, clone before writing."""
    import torch

    obj = unpackb(data, max_bytes=max_bytes)
    if not isinstance(obj, dict):
        raise DecodeError(f"state must be a map, got {type(obj).__name__}")
    for name, tensor in obj.items():
        if not isinstance(name, str) or not isinstance(tensor, torch.Tensor):
            raise DecodeError(f"state entry {name!r} is not str -> Tensor")
    return obj


def state_digest(state: Mapping[str, torch.Tensor]) -> str:
    """Hex sha256 over sorted names, dtypes, shapes and raw bytes: bitwise-equal states match."""
    digest = hashlib.sha256(b"fedmq.state_digest.v1\0")
    digest.update(struct.pack("<Q", len(state)))
    for name in sorted(state):
        encoded_name = name.encode()
        header, data = _tensor_parts(state[name])
        # Length prefixes keep the stream unambiguous; the header fixes the data length.
        digest.update(struct.pack("<Q", len(encoded_name)))
        digest.update(encoded_name)
        digest.update(header)
        digest.update(data)
    return digest.hexdigest()


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
    path: str | os.PathLike[str], key: str = "weights", *, max_bytes: int = DEFAULT_MAX_BYTES
) -> TensorFile:
    """Index the str -> tensor map under `key` in a file holding one msgpack map, reading no tensor data.

    The file is checked as unpackb would check it (framing, the types and
    limits of every other value, trailing bytes), except that the tensor data
    is not read, so a bool tensor holding bytes other than 0 and 1 is only
    refused when it is accessed. Other top-level values are decoded one at a
    time and dropped. Raises DecodeError for a malformed or truncated file, a
    missing key, a value under it that is not a map of str -> tensor, or a file
    over max_bytes; OSError from opening the file propagates.
    """
    with open(path, "rb") as file:
        before = os.fstat(file.fileno())
        if before.st_size > max_bytes:
            raise DecodeError(f"file of {before.st_size} bytes exceeds limit of {max_bytes}")
        scanner = _MapScanner(file, before.st_size)
        entries = scanner.tensors(key)
        if _identity(os.fstat(file.fileno())) != _identity(before):
            raise DecodeError(f"{os.fspath(path)!r} changed while it was indexed")
    return TensorFile(path, entries, _identity(before), scanner.fields)


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
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        entries: dict[str, _Entry],
        identity: tuple[int, ...],
        fields: dict[str | int, Any] | None = None,
    ) -> None:
        self.fields = fields or {}  # the file's other top-level values, decoded
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
        tensor = _tensor_from_payload(self._read(entry.offset, entry.size))
        if tensor.dtype != entry.dtype or tuple(tensor.shape) != entry.shape:
            raise DecodeError(f"tensor {name!r} in {self._path!r} changed since it was indexed")
        return tensor

    def __contains__(self, name: object) -> bool:
        return name in self._entries  # Mapping's default would read the tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"TensorFile({self._path!r}, {len(self._entries)} tensors)"

    def _read(self, offset: int, size: int) -> bytearray:
        """Read size bytes at offset from the indexed file into a new buffer."""
        with open(self._path, "rb", buffering=0) as file:
            if _identity(os.fstat(file.fileno())) != self._identity:
                raise DecodeError(f"{self._path!r} changed since it was indexed")
            file.seek(offset)
            buffer = bytearray(size)
            with memoryview(buffer) as view:
                done = 0
                while done < size:  # one read, unless the OS caps it (Linux: just under 2 GiB)
                    count = file.readinto(view[done:])
                    if not count:
                        raise DecodeError(f"{self._path!r} ended at byte {offset + done} while reading")
                    done += count
        return buffer


class _Writer:
    """Collects encoded chunks; tensor data is kept by reference, so one join copies it."""

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
            packer.pack_map_header(len(obj))
            for key, value in obj.items():
                if not isinstance(key, str | int) or isinstance(key, bool):
                    raise TypeError(f"map keys must be str or int, not {type(key).__name__}")
                packer.pack(key)
                self.write(value, depth + 1)
        elif isinstance(obj, list | tuple):
            if all(type(item) in _FLAT_TYPES for item in obj):
                packer.pack(obj)  # nothing to walk: let msgpack's C loop do it
            else:
                packer.pack_array_header(len(obj))
                for item in obj:
                    self.write(item, depth + 1)
        elif self._tensor_type is not None and isinstance(obj, self._tensor_type):
            header, data = _tensor_parts(obj)
            prefix = _ext_prefix(len(header) + data.nbytes)
            self._chunks += [packer.bytes(), prefix, header, data]
            packer.reset()
        else:
            packer.pack(obj)

    def finish(self) -> bytes:
        """Return everything written as one bytes object."""
        if not self._chunks:
            return self._packer.bytes()
        self._chunks.append(self._packer.bytes())
        return b"".join(self._chunks)


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

    def tensors(self, key: str) -> dict[str, _Entry]:
        """Index the map under key, checking the whole top-level map and that nothing follows it."""
        found: dict[str, _Entry] | None = None
        self.fields: dict[str | int, Any] = {}
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
                else:
                    value = unpacker.unpack()
                    if type(value) is msgpack.Timestamp:
                        raise DecodeError("msgpack timestamp ext is not a fedmq type")
                    self.fields[name] = value
            end = base + unpacker.tell()
        except DecodeError:
            raise
        except _UNPACK_ERRORS as exc:
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
            **_unpack_options(self._size),
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
            start = _header_end(fixed, size)
            dtype, shape = _tensor_header(fixed + self._read(pos + 8, start - 8), size)
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


def _ext_prefix(size: int) -> bytes:
    """Return the msgpack ext header (format byte, length, type) for a tensor payload."""
    if size in _FIXEXT:
        return bytes((_FIXEXT[size], TENSOR_EXT))
    if size <= 0xFF:
        return struct.pack(">BBb", 0xC7, size, TENSOR_EXT)
    if size <= 0xFFFF:
        return struct.pack(">BHb", 0xC8, size, TENSOR_EXT)
    if size <= 0xFFFFFFFF:
        return struct.pack(">BIb", 0xC9, size, TENSOR_EXT)
    raise ValueError(f"tensor payload of {size} bytes exceeds msgpack's 4 GiB ext limit")


def _header_size(ndim: int) -> int:
    """Bytes before the tensor data: fixed fields and dims, padded to _DATA_ALIGN."""
    return -(-(8 + 8 * ndim) // _DATA_ALIGN) * _DATA_ALIGN


def _tensor_parts(tensor: torch.Tensor) -> tuple[bytes, memoryview]:
    """Split a tensor into its ext header and a little-endian view of its data."""
    import torch

    code = _codes_by_dtype().get(tensor.dtype)
    if code is None or tensor.layout != torch.strided:
        raise TypeError(f"cannot encode a {tensor.layout} tensor of dtype {tensor.dtype}")
    if tensor.dim() > _MAX_NDIM:
        raise ValueError(f"cannot encode a tensor with {tensor.dim()} dims (max {_MAX_NDIM})")
    flat = tensor.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1)
    raw = flat.view(torch.uint8)
    width = _swap_width(tensor.dtype)
    if not _LITTLE_ENDIAN and width > 1:
        raw = _swap_bytes(raw, width)
    ndim = tensor.dim()
    header = struct.pack(f"<BB6x{ndim}Q", code, ndim, *tensor.shape)
    return header.ljust(_header_size(ndim), b"\0"), raw.numpy().data


def _tensor_from_payload(payload: bytes | bytearray) -> torch.Tensor:
    """Check a tensor ext payload and return a tensor viewing its data."""
    dtype, shape = _tensor_header(payload, len(payload))
    try:
        return _view_data(payload, _header_size(len(shape)), dtype, shape, math.prod(shape))
    except (RuntimeError, ValueError, OverflowError) as exc:
        raise DecodeError(f"tensor {dtype} {list(shape)} rejected by torch: {exc}") from exc


def _header_end(fixed: bytes | bytearray, size: int) -> int:
    """Offset of the data in a size-byte tensor payload, from its first 8 bytes (fewer if size < 8)."""
    if size < 8:
        raise DecodeError(f"tensor header truncated: {size} bytes")
    ndim = fixed[1]
    if ndim > _MAX_NDIM:
        raise DecodeError(f"tensor has {ndim} dims (max {_MAX_NDIM})")
    start = _header_size(ndim)
    if size < start:
        raise DecodeError(f"tensor header truncated: {size} of {start} bytes")
    return start


def _tensor_header(head: bytes | bytearray, size: int) -> tuple[torch.dtype, tuple[int, ...]]:
    """Check the header of a size-byte tensor payload; head holds at least the header's bytes."""
    start = _header_end(head, size)
    code, ndim = head[0], head[1]
    if any(head[2:8]) or any(head[8 + 8 * ndim : start]):
        raise DecodeError("tensor header has non-zero reserved bytes")
    dtype = _dtypes_by_code().get(code)
    if dtype is None:
        name = _DTYPE_NAMES.get(code)
        reason = f"dtype {name} is not available in this torch" if name else "unknown dtype"
        raise DecodeError(f"tensor dtype code {code}: {reason}")
    shape = struct.unpack_from(f"<{ndim}Q", head, 8)
    if any(dim > _MAX_DIM for dim in shape):
        raise DecodeError(f"tensor dims {shape} exceed int64")
    numel = math.prod(shape)
    if numel * dtype.itemsize != size - start:
        raise DecodeError(
            f"tensor {dtype} {list(shape)} needs {numel * dtype.itemsize} data bytes,"
            f" payload has {size - start}"
        )
    return dtype, shape


def _view_data(
    payload: bytes | bytearray, start: int, dtype: torch.dtype, shape: tuple[int, ...], numel: int
) -> torch.Tensor:
    """Build the tensor over payload[start:] without copying where the host allows."""
    import torch

    if numel == 0:
        return torch.empty(shape, dtype=dtype)  # frombuffer refuses empty buffers
    width = _swap_width(dtype)
    swap = not _LITTLE_ENDIAN and width > 1
    with warnings.catch_warnings():
        # bytes are immutable and torch warns so; the module docstring says to clone first.
        # (TensorFile hands in a private bytearray, which is writable.)
        warnings.filterwarnings("ignore", "The given buffer is not writable", UserWarning)
        flat = torch.frombuffer(
            payload,
            dtype=torch.uint8 if swap else dtype,
            offset=start,
            count=numel * dtype.itemsize if swap else numel,
        )
    if swap:
        flat = _swap_bytes(flat, width).view(dtype)
    elif flat.data_ptr() % dtype.itemsize:
        flat = flat.clone()  # an unusual Python build may not align bytes data
    if dtype == torch.bool and bool(flat.view(torch.uint8).gt(1).any()):
        raise DecodeError("bool tensor holds bytes other than 0 and 1")
    return flat.view(shape)


def _swap_width(dtype: torch.dtype) -> int:
    """Bytes per byte-swapped unit: the itemsize, or half of it for complex parts."""
    return dtype.itemsize // 2 if dtype.is_complex else dtype.itemsize


def _swap_bytes(raw: torch.Tensor, width: int) -> torch.Tensor:
    """Reverse the byte order of each width-byte unit of a flat uint8 tensor (copies)."""
    return raw.view(-1, width).flip(1).reshape(-1)


def _unpack_options(size: int) -> dict[str, Any]:
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


def _ext_to_object(code: int, payload: bytes) -> Any:
    """msgpack ext hook: only tensors are known."""
    if code != TENSOR_EXT:
        raise DecodeError(f"unknown msgpack ext type {code}")
    return _tensor_from_payload(payload)


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


@functools.cache
def _dtypes_by_code() -> dict[int, torch.dtype]:
    """Wire code -> dtype for every dtype this torch has."""
    import torch

    found = {code: getattr(torch, name, None) for code, name in _DTYPE_NAMES.items()}
    return {code: dtype for code, dtype in found.items() if isinstance(dtype, torch.dtype)}


@functools.cache
def _codes_by_dtype() -> dict[torch.dtype, int]:
    """Dtype -> wire code, the inverse of _dtypes_by_code."""
    return {dtype: code for code, dtype in _dtypes_by_code().items()}
