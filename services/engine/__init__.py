"""The in-process engine: `fedmq run` and `fedmq.run()` without a broker, bus or service threads."""
