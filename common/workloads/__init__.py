"""Data helpers for Tasks (public as `fedmq.data`): seeded splits and partitions over clients.

Nothing here imports torch.
"""
