"""The Task contract (contract.py) and what fedmq does with a Task: batching, its training loop,
metric reduction, loading a Task by name and calling it safely (runtime.py)."""
