"""The Python API (public through `fedmq`): jobs run embedded or on a cluster, callbacks, results."""
