"""Are we under CI? There, a missing broker or tool fails the test instead of skipping it."""

from __future__ import annotations

import os

# CI services set CI=true; people write CI=1 or CI=yes. Any case.
TRUE = frozenset({"1", "true", "yes"})


def under_ci() -> bool:
    """True when the CI environment variable says yes (1, true or yes, any case)."""
    return os.environ.get("CI", "").strip().lower() in TRUE
