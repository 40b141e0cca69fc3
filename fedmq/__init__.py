"""fedmq: federated learning and data-parallel training as services over RabbitMQ.

The installed package holds everything under one name: `fedmq.common` (the
shared kernel: settings, messages, codec, bus, job spec) and `fedmq.services`
(scheduler, aggregator, learner, CLI).
"""

__version__ = "0.2.0"
