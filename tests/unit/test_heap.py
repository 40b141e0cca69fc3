"""common/heap.py: after a large model, the large buffers a process frees go back to the OS."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

RETAINED = """
import re, sys
from fedmq.common import heap
if sys.argv[1] == "fixed":
    heap.large_buffers_unmapped()
def rss():
    return int(re.search(r"VmRSS:\\s+(\\d+)", open("/proc/self/status").read()).group(1))
big = bytearray(16 << 20)  # mapped, and freed: glibc's threshold rises to 16 MiB
del big
before = rss()
block = bytearray(8 << 20)  # below that threshold now: from the heap, unless fixed
del block
print(rss() - before)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's malloc only")
def test_after_a_large_model_freed_buffers_go_back_to_the_os() -> None:
    """Process-wide, so each case runs in a child: 8 MiB freed stays with a process whose threshold
    rose, and goes back once it is fixed."""

    def kept_kib(mode: str) -> int:
        child = [sys.executable, "-c", RETAINED, mode]
        return int(subprocess.run(child, capture_output=True, text=True, check=True).stdout.strip())

    assert kept_kib("glibc") > 4 * 1024
    assert kept_kib("fixed") < 1024
