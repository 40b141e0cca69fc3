"""Msgpack codec for fedmq messages, with torch tensors as an explicit extension type.

Never pickle: every decoded byte is checked and anything malformed raises
``DecodeError``. torch is imported only when a tensor is met, so the control
plane can use the codec without it. One layer per module::

    pack     packb, unpackb: msgpack with fedmq's types, checks and size limits
    tensors  the tensor ext payload: layout, dtype codes, header checks
    state    name -> tensor maps: encode_state, decode_state, state_digest
    files    messages on disk: unpack_file, index_tensors -> lazy TensorFile
"""

from fedmq.common.codec.files import TensorFile, index_tensors, unpack_file
from fedmq.common.codec.pack import DEFAULT_MAX_BYTES, Encoded, packb, packb_parts, unpackb
from fedmq.common.codec.state import decode_state, encode_state, state_digest
from fedmq.common.codec.tensors import TENSOR_EXT

__all__ = [
    "DEFAULT_MAX_BYTES",
    "Encoded",
    "TENSOR_EXT",
    "TensorFile",
    "decode_state",
    "encode_state",
    "index_tensors",
    "packb",
    "packb_parts",
    "state_digest",
    "unpack_file",
    "unpackb",
]
