"""Tests for fedmq.common.codec's file decoding: unpack_file and the lazy TensorFile from index_tensors."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedmq.common.codec import TENSOR_EXT, TensorFile, index_tensors, packb, unpack_file, unpackb
from fedmq.common.errors import DecodeError
from fedmq.common.messages import ClientUpdate, ModelReply, to_wire
from tests.unit.codec_support import (
    DTYPES,
    REPO_ROOT,
    assert_same_tensor,
    header,
    pack_ext,
    tensor_from_bytes,
)

pytestmark = pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental")


def update_bytes(weights: dict[str, Any], **fields: Any) -> bytes:
    """The wire bytes of a ClientUpdate carrying these weights."""
    message = ClientUpdate(
        job_id="job",
        task_id="task",
        round=3,
        client=7,
        base_digest="ab" * 32,
        num_examples=120,
        metrics={"loss": 0.25, "accuracy": 0.9},
        weights=weights,
        **fields,
    )
    return to_wire(message)


def write(path: Path, data: bytes) -> Path:
    path.write_bytes(data)
    return path


def every_dtype_state() -> dict[str, torch.Tensor]:
    """One tensor per dtype and shape, 0-d and empty included, with distinct bits in each."""
    state: dict[str, torch.Tensor] = {}
    for dtype in DTYPES:
        for shape in [(), (0,), (3, 0, 2), (5,), (2, 3)]:
            size = math.prod(shape) * dtype.itemsize
            raw = bytes((i * 37 + len(state)) % 256 for i in range(size))
            state[f"{dtype}/{shape}"] = tensor_from_bytes(raw, dtype, shape)
    return state


def read_all(tensors: TensorFile) -> dict[str, torch.Tensor]:
    return {name: tensors[name] for name in tensors}


def small_update() -> bytes:
    return update_bytes(
        {
            "conv.weight": torch.arange(6, dtype=torch.float32).reshape(2, 3),
            "scale": torch.tensor(0.5, dtype=torch.bfloat16),
            "mask": torch.tensor([True, False, True]),
            "empty": torch.empty(0, 3, dtype=torch.float16),
            "steps": torch.tensor([1, 2], dtype=torch.int64),
        }
    )


# Indexing matches decoding the whole file


def test_an_indexed_update_holds_the_same_tensors_as_decoding_it_whole(tmp_path: Path) -> None:
    state = every_dtype_state()
    path = write(tmp_path / "update.msgpack", update_bytes(state))
    whole = unpackb(path.read_bytes())["weights"]
    tensors = index_tensors(path)
    assert list(tensors) == list(whole) == list(state)
    assert len(tensors) == len(state)
    for name, expected in whole.items():
        assert tensors.meta(name) == (expected.dtype, expected.shape)
        assert_same_tensor(tensors[name], expected)
        assert_same_tensor(tensors[name], state[name])


def test_names_iterate_in_file_order_not_sorted(tmp_path: Path) -> None:
    names = ["z.bias", "a.weight", "m", "ünïcode", "", "0"]
    path = write(tmp_path / "u", update_bytes({name: torch.ones(1) for name in names}))
    tensors = index_tensors(path)
    assert list(tensors) == names
    assert list(tensors.keys()) == names
    assert [name for name, _ in tensors.items()] == names


def test_meta_len_and_membership_read_nothing_once_indexed(tmp_path: Path) -> None:
    path = write(tmp_path / "u", update_bytes({"w": torch.zeros(4, 5, dtype=torch.float64)}))
    tensors = index_tensors(path)
    path.unlink()
    assert tensors.meta("w") == (torch.float64, torch.Size([4, 5]))
    assert len(tensors) == 1
    assert "w" in tensors
    assert "v" not in tensors
    with pytest.raises(FileNotFoundError):
        tensors["w"]


def test_an_unknown_name_raises_key_error_as_a_mapping_should(tmp_path: Path) -> None:
    tensors = index_tensors(write(tmp_path / "u", small_update()))
    with pytest.raises(KeyError):
        tensors["nope"]
    with pytest.raises(KeyError):
        tensors.meta("nope")
    assert tensors.get("nope") is None


def test_each_access_returns_a_fresh_tensor_that_may_be_written(tmp_path: Path) -> None:
    path = write(tmp_path / "u", update_bytes({"w": torch.zeros(3)}))
    before = path.read_bytes()
    tensors = index_tensors(path)
    first = tensors["w"]
    first += 1
    assert torch.equal(tensors["w"], torch.zeros(3))
    assert path.read_bytes() == before


def test_read_tensors_are_aligned_for_their_dtype(tmp_path: Path) -> None:
    state = {f"t{i}": torch.ones(i + 1, dtype=torch.complex128) for i in range(5)}
    state["odd"] = torch.ones(3, dtype=torch.uint8)
    tensors = index_tensors(write(tmp_path / "u", update_bytes(state)))
    for tensor in read_all(tensors).values():
        assert tensor.data_ptr() % tensor.dtype.itemsize == 0


def test_threads_may_read_one_tensor_file_at_once(tmp_path: Path) -> None:
    state = {f"layer{i}": torch.randn(64, 64) for i in range(16)}
    tensors = index_tensors(write(tmp_path / "u", update_bytes(state)))
    with ThreadPoolExecutor(8) as pool:
        read = list(pool.map(tensors.__getitem__, list(state) * 4))
    for tensor, name in zip(read, list(state) * 4, strict=True):
        assert_same_tensor(tensor, state[name])


def test_a_tensor_major_fold_over_several_files_matches_decoding_them_whole(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(0)
    updates = [
        {"w": torch.randn(8, 4, generator=generator), "b": torch.randn(4, generator=generator)}
        for _ in range(4)
    ]
    paths = [write(tmp_path / f"c{i}", update_bytes(u)) for i, u in enumerate(updates)]
    files = [index_tensors(path) for path in paths]
    folded = {name: torch.stack([f[name] for f in files]).mean(0) for name in files[0]}
    whole = [unpack_file(path)["weights"] for path in paths]
    assert list(folded) == ["w", "b"]
    for name, tensor in folded.items():
        assert torch.equal(tensor, torch.stack([w[name] for w in whole]).mean(0))


def test_other_top_level_values_may_come_before_or_after_the_tensors(tmp_path: Path) -> None:
    data = packb(
        {
            "head": [1, {"x": b"\x00" * 70000, "t": torch.ones(2)}, "s" * 300],
            "state": {"a": torch.arange(3)},
            7: None,
            "tail": {"deep": [[[1.5]]]},
        }
    )
    tensors = index_tensors(write(tmp_path / "u", data), key="state")
    assert list(tensors) == ["a"]
    assert_same_tensor(tensors["a"], torch.arange(3))


def test_an_empty_tensor_map_indexes_to_an_empty_file(tmp_path: Path) -> None:
    tensors = index_tensors(write(tmp_path / "u", update_bytes({})))
    assert len(tensors) == 0
    assert list(tensors) == []


def test_tensor_payloads_on_each_ext_length_boundary_index(tmp_path: Path) -> None:
    # Payload sizes 1..16 use fixext, then ext 8, 16 and 32 (header 16 bytes + data).
    state = {f"n{n}": torch.zeros(n, dtype=torch.uint8) for n in (0, 223, 224, 65503, 65520, 70000)}
    tensors = index_tensors(write(tmp_path / "u", update_bytes(state)))
    for name, tensor in state.items():
        assert_same_tensor(tensors[name], tensor)


def test_unpack_file_decodes_exactly_what_unpackb_decodes(tmp_path: Path) -> None:
    data = update_bytes(every_dtype_state())
    from_file = unpack_file(write(tmp_path / "u", data))
    whole = unpackb(data)
    assert list(from_file) == list(whole)
    for key, value in whole.items():
        if key == "weights":
            for name, tensor in value.items():
                assert_same_tensor(from_file[key][name], tensor)
        else:
            assert from_file[key] == value


def test_unpack_file_decodes_plain_values_and_refuses_trailing_bytes(tmp_path: Path) -> None:
    assert unpack_file(write(tmp_path / "a", packb({"a": [1, "x"]}))) == {"a": [1, "x"]}
    with pytest.raises(DecodeError):
        unpack_file(write(tmp_path / "b", packb({"a": 1}) + b"\x00"))
    with pytest.raises(DecodeError):
        unpack_file(write(tmp_path / "c", b""))


def test_files_over_max_bytes_raise_decode_error(tmp_path: Path) -> None:
    data = small_update()
    path = write(tmp_path / "u", data)
    assert len(index_tensors(path, max_bytes=len(data))) == 5
    assert unpack_file(path, max_bytes=len(data))
    with pytest.raises(DecodeError, match="exceeds limit"):
        index_tensors(path, max_bytes=len(data) - 1)
    with pytest.raises(DecodeError, match="exceeds limit"):
        unpack_file(path, max_bytes=len(data) - 1)


def test_a_missing_file_is_an_os_error_not_a_decode_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        index_tensors(tmp_path / "missing")
    with pytest.raises(FileNotFoundError):
        unpack_file(tmp_path / "missing")


# Malformed files


def test_a_file_truncated_anywhere_raises_decode_error_when_indexed(tmp_path: Path) -> None:
    data = small_update()
    path = tmp_path / "u"
    for end in range(len(data)):
        write(path, data[:end])
        with pytest.raises(DecodeError):
            index_tensors(path)


def test_a_file_truncated_or_rewritten_after_indexing_raises_decode_error_on_access(tmp_path: Path) -> None:
    data = small_update()
    path = write(tmp_path / "u", data)
    for end in (len(data) - 1, len(data) // 2, 10, 0):
        tensors = index_tensors(write(path, data))
        os.truncate(path, end)
        for name in tensors:
            with pytest.raises(DecodeError):
                tensors[name]
    tensors = index_tensors(write(path, data))
    replacement = write(tmp_path / "v", update_bytes({"conv.weight": torch.zeros(1)}))
    os.replace(replacement, path)
    with pytest.raises(DecodeError, match="changed"):
        tensors["conv.weight"]


@pytest.mark.parametrize(
    "data",
    [b"", b"\x00", b"\xc1", b"not msgpack at all", bytes(range(256)), b"\x91\x01", b"\xa7weights"],
    ids=["empty", "int", "reserved", "text", "bytes", "array", "str"],
)
def test_garbage_files_raise_decode_error(tmp_path: Path, data: bytes) -> None:
    path = write(tmp_path / "u", data)
    with pytest.raises(DecodeError):
        index_tensors(path)


def test_random_garbage_files_raise_decode_error(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(1)
    for size in (1, 7, 100, 5000):
        data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=generator).numpy().tobytes()
        with pytest.raises(DecodeError):
            index_tensors(write(tmp_path / "u", data))


@pytest.mark.parametrize("key", ["nope", "round", "metrics_", "job_id", "v"])
def test_a_key_that_is_missing_or_not_a_tensor_map_raises_decode_error(tmp_path: Path, key: str) -> None:
    path = write(tmp_path / "u", small_update())
    with pytest.raises(DecodeError):
        index_tensors(path, key=key)


def test_a_message_whose_weights_are_none_raises_decode_error(tmp_path: Path) -> None:
    path = write(tmp_path / "u", to_wire(ModelReply(job_id="j", digest="d", error="gone")))
    with pytest.raises(DecodeError, match="must be a map"):
        index_tensors(path)


def raw_map(*pairs: bytes) -> bytes:
    """msgpack bytes of a map from already-encoded keys and values, bypassing every check."""
    return bytes([0x80 | len(pairs) // 2]) + b"".join(pairs)


ONE = packb(torch.ones(1))


def one_tensor(name: bytes, value: bytes) -> bytes:
    """A file whose weights map has one entry, both sides already encoded."""
    return raw_map(packb("weights"), raw_map(name, value))


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (packb({"weights": {"a": 1.0}}), "not a tensor"),
        (packb({"weights": {"a": [torch.ones(1)]}}), "not a tensor"),
        (packb({"weights": {"a": {"b": torch.ones(1)}}}), "not a tensor"),
        (packb({"weights": {"a": b"\x00" * 16}}), "not a tensor"),
        (packb({"weights": {3: torch.ones(1)}}), "not a str"),
        (one_tensor(packb(b"a"), ONE), "not a str"),
        (one_tensor(b"\xa1\xff", ONE), "UTF-8"),
        (one_tensor(packb("a"), pack_ext(2, b"\x00" * 16)), "ext type 2"),
        (one_tensor(packb("a"), b"\xd6\xff" + bytes(4)), "ext type -1"),
        (raw_map(packb("weights"), raw_map(packb("a"), ONE, packb("a"), ONE)), "duplicate"),
        (raw_map(packb("weights"), packb({}), packb("weights"), packb({})), "duplicate"),
        (raw_map(packb("weights"), packb({}), packb(1.5), packb(0)), "key"),
        (raw_map(packb("weights"), packb({}), packb("t"), b"\xd6\xff" + bytes(4)), "timestamp"),
        (raw_map(packb("weights"), packb({}), packb("x"), b"\xa1\xff"), "malformed"),
        (raw_map(packb("x"), pack_ext(5, b"")), "ext type"),
        (one_tensor(packb("a"), pack_ext(TENSOR_EXT, header(99, (1,)) + b"x")), "dtype"),
        (one_tensor(packb("a"), pack_ext(TENSOR_EXT, header(12, (3,)) + bytes(4))), "needs"),
        (one_tensor(packb("a"), pack_ext(TENSOR_EXT, b"\x0c")), "truncated"),
        (raw_map(packb("weights"), b"\xdf\xff\xff\xff\xff"), "claims"),
        (packb({"weights": {}}) + b"\x00", "after the top-level map"),
    ],
    ids=[
        "float",
        "list",
        "map",
        "bin",
        "int-name",
        "bytes-name",
        "bad-utf8-name",
        "other-ext",
        "timestamp-tensor",
        "duplicate-name",
        "duplicate-key",
        "float-key",
        "timestamp-field",
        "bad-utf8-field",
        "unknown-ext-field",
        "unknown-dtype",
        "short-data",
        "short-header",
        "huge-map",
        "trailing-byte",
    ],
)  # fmt: skip
def test_a_malformed_tensor_map_or_field_raises_decode_error_when_indexed(
    tmp_path: Path, data: bytes, reason: str
) -> None:
    path = write(tmp_path / "u", data)
    with pytest.raises(DecodeError, match=reason):
        index_tensors(path)
    assert whole_file_weights(data) is None  # decoding the whole file agrees


def test_a_bool_tensor_with_bytes_other_than_0_and_1_raises_decode_error_on_access(tmp_path: Path) -> None:
    payload = header(1, (2,)) + b"\x01\x02"
    data = one_tensor(packb("m"), pack_ext(TENSOR_EXT, payload))
    tensors = index_tensors(write(tmp_path / "u", data))
    assert tensors.meta("m") == (torch.bool, torch.Size([2]))
    with pytest.raises(DecodeError, match="bool"):
        tensors["m"]


# Fuzz: index_tensors agrees with decoding the whole file


VALID = small_update()


@pytest.fixture(scope="module")
def fuzz_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One file the fuzz rewrites for each example (hypothesis cannot use function-scoped tmp_path)."""
    return tmp_path_factory.mktemp("fuzz") / "mutated"


def whole_file_weights(data: bytes) -> dict[str, torch.Tensor] | None:
    """The tensors unpackb finds under "weights", or None where it refuses the bytes or the map."""
    try:
        obj = unpackb(data)
    except DecodeError:
        return None
    weights = obj.get("weights") if isinstance(obj, dict) else None
    if not isinstance(weights, dict):
        return None
    if not all(type(k) is str and isinstance(v, torch.Tensor) for k, v in weights.items()):
        return None
    return weights


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    edits=st.lists(
        st.tuples(st.integers(0, len(VALID) - 1), st.integers(0, 255), st.sampled_from("sid")),
        min_size=1,
        max_size=4,
    )
)
def test_mutated_files_index_exactly_when_the_whole_file_decodes(
    fuzz_path: Path, edits: list[tuple[int, int, str]]
) -> None:
    data = bytearray(VALID)
    for position, value, kind in edits:
        position %= len(data) or 1
        if kind == "s" and data:
            data[position] = value
        elif kind == "i":
            data.insert(position, value)
        elif data:
            del data[position]
    path = write(fuzz_path, bytes(data))
    try:
        from_file: dict[str, torch.Tensor] | None = read_all(index_tensors(path))
    except DecodeError:
        from_file = None
    expected = whole_file_weights(bytes(data))
    if expected is None:
        assert from_file is None
    else:
        assert from_file is not None
        assert list(from_file) == list(expected)
        for name, tensor in expected.items():
            assert_same_tensor(from_file[name], tensor)


def test_the_fuzz_base_indexes_and_msgpack_sees_one_map() -> None:
    assert isinstance(msgpack.unpackb(VALID, ext_hook=lambda c, d: c, raw=True), dict)
    assert whole_file_weights(VALID) is not None


# Memory

# Measured (torch 2.13 CPU, Python 3.11, Linux x86-64) on a 64 MiB ClientUpdate of 16 float32
# tensors of 4 MiB each, in a fresh process:
#   index_tensors                      tracemalloc peak 0.12 MiB (two msgpack Unpackers; no tensor data)
#   index + read each tensor once      tracemalloc peak 4.0 MiB, peak-RSS delta 5.1 MiB: about one tensor
#   unpack_file, for contrast          tracemalloc peak 128 MiB (the file's bytes + the decoded copy)
MEMORY_SCRIPT = r"""
import json, os, re, resource, sys, tracemalloc
import torch
from fedmq.common.codec import index_tensors, unpack_file

path = sys.argv[1]

def peak_rss():
    # Linux: reset the peak to the current RSS first, so torch's import peak does not hide ours.
    if os.path.exists("/proc/self/status"):
        with open("/proc/self/status") as status:
            return int(re.search(r"VmHWM:\s+(\d+)", status.read()).group(1)) * 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)

def fold(tensors):
    total = 0.0
    for name in tensors:
        total += float(tensors[name].sum())
    return total

fold({"warm-up": torch.ones(8)})  # torch's first op sets up its thread pool
if os.path.exists("/proc/self/clear_refs"):
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
before = peak_rss()
fold(index_tensors(path))
rss_delta = peak_rss() - before

tracemalloc.start()
tensors = index_tensors(path)
index_peak = tracemalloc.get_traced_memory()[1]
tracemalloc.reset_peak()
fold(tensors)
read_peak = tracemalloc.get_traced_memory()[1]
tracemalloc.reset_peak()
whole = unpack_file(path)
whole_peak = tracemalloc.get_traced_memory()[1]
print(json.dumps({"rss_delta": rss_delta, "index_peak": index_peak, "read_peak": read_peak,
                  "whole_peak": whole_peak}))
"""


@pytest.mark.slow  # 7 s: a large file's peak memory
@pytest.mark.skipif(sys.platform == "win32", reason="needs the resource module")
def test_indexing_and_reading_each_tensor_once_holds_about_one_tensor_in_memory(tmp_path: Path) -> None:
    tensor_bytes = 4 * 1024**2
    state = {f"layer{i}.weight": torch.full((tensor_bytes // 4,), float(i)) for i in range(16)}
    path = write(tmp_path / "big.msgpack", update_bytes(state))
    del state
    assert path.stat().st_size > 16 * tensor_bytes
    result = subprocess.run(
        [sys.executable, "-c", MEMORY_SCRIPT, str(path)],
        cwd=REPO_ROOT,
        check=True,
        timeout=120,
        capture_output=True,
        text=True,
    )
    figures = json.loads(result.stdout)
    print(figures)
    assert figures["index_peak"] < tensor_bytes / 8  # no tensor data is read to index
    assert figures["read_peak"] < 1.5 * tensor_bytes  # one tensor at a time, not the file
    assert figures["rss_delta"] < 2.5 * tensor_bytes
    assert figures["whole_peak"] > 15 * tensor_bytes  # the instrument does see a whole-file decode
