"""A legitimate-looking Task in a module no allow-list of the tests names: importing it is the bug.

The allow-list tests name `tests.support.outsider:Outsider` with FEDMQ_ALLOWED_CODE left at its
default (or narrowed to `tests.integration`): no service may import this module, so it must
never appear in sys.modules, and a service process that did would print MARK to its log.
"""

from __future__ import annotations

from fedmq.tasks.digits import Digits

MARK = "tests.support.outsider was imported"
print(MARK, flush=True)


class Outsider(Digits):
    """The digits Task under another name."""
