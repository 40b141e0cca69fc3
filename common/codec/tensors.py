"""The tensor wire format: the payload of fedmq's msgpack tensor extension, and its checks.

A tensor is a msgpack ext of type ``TENSOR_EXT`` whose payload is::

    offset      size       field (integers little-endian)
    0           1          dtype code, u8 (see _DTYPE_NAMES)
    1           1          ndim, u8, at most 64
    2           6          reserved, zero
    8           8 * ndim   dims, u64 each, outermost first
    8 + 8*ndim  0 or 8     zero padding, so the data starts at a multiple of 16
    H           n          elements in C order, little-endian; n = numel * itemsize

Encoding splits a tensor into its header and a view of its data, so the caller
copies the data once, into its output. Decoding checks the whole header, then
views the payload's data without a copy. torch is imported only inside the
functions that handle a tensor.
"""

from __future__ import annotations

import functools
import math
import struct
import sys
import warnings
from typing import TYPE_CHECKING

from fedmq.common.errors import DecodeError

if TYPE_CHECKING:
    import torch

TENSOR_EXT: int = 1

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
_LITTLE_ENDIAN = sys.byteorder == "little"


def tensor_parts(tensor: torch.Tensor) -> tuple[bytes, memoryview]:
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


def tensor_from_payload(payload: bytes | bytearray | memoryview) -> torch.Tensor:
    """Check a tensor ext payload and return a tensor viewing its data."""
    dtype, shape = tensor_header(payload, len(payload))
    return tensor_from_data(payload, _header_size(len(shape)), dtype, shape)


def tensor_from_data(
    data: bytes | bytearray | memoryview, start: int, dtype: torch.dtype, shape: tuple[int, ...]
) -> torch.Tensor:
    """A tensor of `shape` over the raw little-endian data at data[start:] (a payload's, or one row
    of a stored tensor read alone); DecodeError if torch refuses it."""
    try:
        return _view_data(data, start, dtype, shape, math.prod(shape))
    except (RuntimeError, ValueError, OverflowError) as exc:
        raise DecodeError(f"tensor {dtype} {list(shape)} rejected by torch: {exc}") from exc


def data_offset(ndim: int) -> int:
    """Where a tensor payload's data starts: after its header (see tensor_parts)."""
    return _header_size(ndim)


def header_end(fixed: bytes | bytearray | memoryview, size: int) -> int:
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


def tensor_header(head: bytes | bytearray | memoryview, size: int) -> tuple[torch.dtype, tuple[int, ...]]:
    """Check the header of a size-byte tensor payload; head holds at least the header's bytes."""
    start = header_end(head, size)
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


def _header_size(ndim: int) -> int:
    """Bytes before the tensor data: fixed fields and dims, padded to _DATA_ALIGN."""
    return -(-(8 + 8 * ndim) // _DATA_ALIGN) * _DATA_ALIGN


def _view_data(
    payload: bytes | bytearray | memoryview, start: int, dtype: torch.dtype, shape: tuple[int, ...],
    numel: int,
) -> torch.Tensor:
    """Build the tensor over payload[start:] without copying where the host allows."""
    import torch

    if numel == 0:
        return torch.empty(shape, dtype=dtype)  # frombuffer refuses empty buffers
    width = _swap_width(dtype)
    swap = not _LITTLE_ENDIAN and width > 1
    with warnings.catch_warnings():
        # bytes are immutable and torch warns so; unpackb's docs say to clone first.
        # (TensorFile hands in a private buffer, which is writable.)
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
