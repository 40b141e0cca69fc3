"""One rank of a DDP group: `python -m fedmq.services.learner.ddp_child` imports and calls the entry.

The learner starts it with the rank's environment (MASTER_ADDR ... NODE_RANK, FEDMQ_DDP_*),
once it has checked the entry against its allow-list (FEDMQ_ALLOWED_CODE; in `fedmq run` the
user's project too). Exit code: the entry's (0 when it returns), 2 when it is no function, 1
with the traceback on stderr when it raises.
"""

from __future__ import annotations

import importlib
import os
import sys
import threading
import time


def _die_with_the_learner() -> None:
    """A rank outlives no learner (a SIGKILLed one cannot stop it): exit once the parent is gone."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(0.5)
        os._exit(137)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def main() -> int:
    _die_with_the_learner()
    entry = os.environ.get("FEDMQ_DDP_ENTRY", "")
    module, _, name = entry.partition(":")
    fn = getattr(importlib.import_module(module), name, None)
    if not callable(fn):
        print(f"fedmq: entry {entry!r} is not a function of {module}", file=sys.stderr)
        return 2
    result = fn()
    return result if isinstance(result, int) else 0


if __name__ == "__main__":
    sys.exit(main())
