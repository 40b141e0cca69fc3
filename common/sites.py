"""What a site's name may be: one rule for the job spec, the settings (FEDMQ_SITES) and the topology.

A site's name becomes part of a queue's name (common/bus/topology.py: fedmq.site.<name>), so it
is held to what a queue name and a metric label can carry.
"""

from __future__ import annotations

import re

SITE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,63}\Z")  # \Z: no trailing newline
