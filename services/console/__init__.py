"""`fedmq console`: a web console over the broker (jobs, rounds, learners, DDP groups; submit, cancel,
download), with the CLI's broker user and its checks. docs/console.md describes it."""
