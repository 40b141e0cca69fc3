"""Strategies: the public contract (contract), per-client state on disk (clients), loading by name."""
