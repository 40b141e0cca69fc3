"""Aggregation maths: pure functions, tensors in and tensors out. No I/O, no settings, no logging.

One module per family: `mean` (weighted means, server momentum, moving averages), and beside it
the robust, adaptive, private and compression kernels. Strategies call these; tests check them
against independent NumPy implementations of each paper's formula.
"""

from fedmq.services.aggregator.kernels.mean import (
    StateDict,
    moving_average,
    server_momentum,
    weighted_mean,
)
from fedmq.services.aggregator.kernels.scaffold import scaffold_step

__all__ = ["StateDict", "moving_average", "scaffold_step", "server_momentum", "weighted_mean"]
