"""The small tree of errors fedmq raises on purpose."""


class FedmqError(Exception):
    """Base of every expected fedmq error."""


class ConfigError(FedmqError):
    """A job spec or setting is wrong; the message says which field and what is allowed."""


class SetupError(ConfigError):
    """A job cannot start for a reason outside its spec's text: a file that cannot be read, a module
    that is not installed. The CLI does not tell the user to fix the spec."""


class ClientDataError(FedmqError):
    """A client's data cannot train, the same way every time (it holds none): its failure is final
    for the round, not retried."""


class DecodeError(FedmqError):
    """Bytes from the wire or disk are not a valid fedmq message or tensor."""


class ValidationError(FedmqError):
    """A well-formed message breaks a rule: wrong shape, stale round, unknown job."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason
        self.detail = detail


class AggregationError(FedmqError):
    """A round's results cannot be combined into a new global model."""


class BrokerUnavailable(FedmqError):
    """The message broker cannot be reached."""


class StateUnwritable(FedmqError):
    """A service could not write its state to disk (full, read-only, gone): wait and retry, lose nothing."""

    def __init__(self, path: str, errno: int | None, detail: str) -> None:
        super().__init__(f"cannot write {path}: {detail}")
        self.path = path
        self.errno = errno
        self.detail = detail
