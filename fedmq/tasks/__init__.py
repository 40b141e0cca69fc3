"""Built-in Tasks, each written against the public `fedmq` contract only."""
