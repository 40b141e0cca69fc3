"""Prometheus metrics of every fedmq service, on a registry the service's app module owns.

Names follow Prometheus conventions (`fedmq_` prefix, unit suffixes, `_total`
counters). Label values stay bounded: reasons and codes are short fixed words,
`fl_job` is a job id (one series per job; Prometheus's own `job` label names
the scraped service).
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

from fedmq.common.task.metrics import MAX_NAMES, NAME, SOURCES

# Local training and rounds last from milliseconds (tests) to an hour (real models);
# prometheus-client's default buckets stop at 10 s.
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)


# The bounded vocabularies of the labelled counters, exported at 0 from the start so a
# dashboard query finds the series before the first rejection happens.
UPDATE_REASONS = (
    "decode", "unknown_job", "stale_round", "unknown_client", "stale_model", "wrong_tensors",
    "wrong_dtype", "wrong_shape", "non_finite", "bad_example_count", "wrong_extras", "bad_compression",
    "sender", "implausible_examples", "update_norm", "site_sender",
)
MESSAGE_REASONS = (
    *UPDATE_REASONS, "invalid_spec", "code_not_allowed", "over_limit", "unexpected_type", "blob", "oversize",
    "handler_error", "other",
)
FAILURE_CODES = ("user_code", "invalid", "error", "no_site_learner")
CODE_KINDS = ("task", "strategy", "trainer", "entry")  # what a spec names code for (common/coderefs.py)
# Jobs refused or failed for passing a limit: the spec's own size (common/speclimits) or a
# deployment's (settings: FEDMQ_MAX_*, FEDMQ_JOB_DISK_BYTES).
JOB_LIMITS = (
    "spec_bytes", "spec_nodes", "spec_depth", "options_bytes", "max_clients", "max_rounds", "max_jobs",
    "model_bytes", "disk_quota",
)


def reason_label(reason: str) -> str:
    """The fixed word before the first ':' of a rejection reason ('wrong_shape: layer.0' → 'wrong_shape')."""
    word = reason.split(":", 1)[0].strip().lower()
    return word[:40] if word.replace("_", "").isalnum() else "other"


@dataclass
class Metrics:
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)
    _exported: dict[tuple[str, str], set[str]] = field(default_factory=dict, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)

    def __post_init__(self) -> None:
        r = self.registry
        self.rounds_completed = Counter(
            "fedmq_rounds_completed_total", "Rounds closed with a new global model", ["fl_job"], registry=r
        )
        self.round_duration = Histogram(
            "fedmq_round_duration_seconds", "Round wall time from opening to the new global model",
            buckets=DURATION_BUCKETS, registry=r,
        )
        self.round_metric = Gauge(
            "fedmq_round_metric",
            "A metric of the latest round, by job, source (train, federated, server, strategy, transport) "
            "and name",
            ["fl_job", "source", "name"], registry=r,
        )
        self.current_round = Gauge("fedmq_job_round", "The round a job is in", ["fl_job"], registry=r)
        self.ddp_step = Gauge(
            "fedmq_ddp_step", "The step or epoch of a DDP job's latest report (fedmq.ddp.report)", ["fl_job"],
            registry=r,
        )
        self.round_retries = Counter(
            "fedmq_round_retries_total", "Rounds below quorum at their deadline, dispatched again", registry=r
        )
        self.tasks_redispatched = Counter(
            "fedmq_tasks_redispatched_total", "Tasks sent again near their round's deadline", registry=r
        )
        self.rounds_closed_at_deadline = Counter(
            "fedmq_rounds_closed_at_deadline_total", "Rounds closed with quorum but not every client",
            registry=r,
        )
        self.updates_accepted = Counter(
            "fedmq_updates_accepted_total", "Client updates stored for aggregation", registry=r
        )
        self.updates_rejected = Counter(
            "fedmq_updates_rejected_total", "Client updates refused, by reason", ["reason"], registry=r
        )
        self.messages_rejected = Counter(
            "fedmq_messages_rejected_total", "Messages dead-lettered, by reason", ["reason"], registry=r
        )
        self.jobs_refused = Counter(
            "fedmq_jobs_refused_total", "Jobs refused or failed for passing a limit, by limit", ["limit"],
            registry=r,
        )
        self.client_failures = Counter(
            "fedmq_client_failures_total", "Tasks a learner could not train, by code", ["code"], registry=r
        )
        self.code_refused = Counter(
            "fedmq_code_refused_total",
            "Jobs refused for naming code outside the allow-list (FEDMQ_ALLOWED_CODE), by what it was",
            ["what"], registry=r,
        )
        self.state_write_errors = Counter(
            "fedmq_state_write_errors_total", "Writes of this service's state that failed (retried)",
            registry=r,
        )
        self.bytes_published = Counter(
            "fedmq_bus_published_bytes_total", "Bytes this service published to the broker", registry=r
        )
        self.bytes_consumed = Counter(
            "fedmq_bus_consumed_bytes_total", "Bytes this service received from the broker", registry=r
        )
        self.train_seconds = Histogram(
            "fedmq_learner_train_seconds", "Local training time of one client task",
            buckets=DURATION_BUCKETS, registry=r,
        )
        self.model_fetches = Counter(
            "fedmq_learner_model_fetches_total", "Global models fetched over the bus (cache misses)",
            registry=r,
        )
        self.models_shared = Counter(
            "fedmq_learner_models_shared_total", "Global models read from the folder this host's learners "
            "share (FEDMQ_SHARED_MODELS_DIR) instead of fetched over the bus", registry=r,
        )
        self.state_cache = Counter(
            "fedmq_learner_state_cache_total", "Client state kept by its learner: hit (used, not "
            "fetched), miss (fetched), spilled (to disk), evicted, too_large", ["event"], registry=r,
        )
        self.learners_alive = Gauge("fedmq_learners_alive", "Learners heard from recently", registry=r)
        self.learners_busy = Gauge("fedmq_learners_busy", "Alive learners training a task", registry=r)
        self.tasks_in_flight = Gauge(
            "fedmq_tasks_in_flight", "Sampled clients of open rounds not yet reported", registry=r
        )
        for reason in UPDATE_REASONS:
            self.updates_rejected.labels(reason)
        for reason in MESSAGE_REASONS:
            self.messages_rejected.labels(reason)
        for code in FAILURE_CODES:
            self.client_failures.labels(code)
        for what in CODE_KINDS:
            self.code_refused.labels(what)
        for limit in JOB_LIMITS:
            self.jobs_refused.labels(limit)

    def round_metrics(self, job_id: str, metrics: Mapping[str, Mapping[str, float]]) -> None:
        """Set a job's latest round metrics, {source: {name: value}}, with bounded label values.

        Clients may report different names (per-class metrics on non-IID data), and so may
        rounds: whatever they do, a job exports the known sources, at most MAX_NAMES
        names per source (the first in sorted order; the job's history keeps every one), and a
        name the latest round of a source no longer has is removed, not left stale.
        """
        with self._lock:
            for source, values in metrics.items():
                if source not in SOURCES:
                    continue
                names = sorted(n for n in values if isinstance(n, str) and NAME.match(n))[:MAX_NAMES]
                key = (job_id, source)
                for gone in self._exported.get(key, set()) - set(names):
                    self.round_metric.remove(job_id, source, gone)
                for name in names:
                    self.round_metric.labels(job_id, source, name).set(values[name])
                self._exported[key] = set(names)

    def dead_letter(self, reason: str) -> None:
        """Hook for Bus.on_dead_letter: every message this service dead-lettered, by reason."""
        label = reason_label(reason)
        self.messages_rejected.labels(label if label in MESSAGE_REASONS else "other").inc()

    def refused_code(self, what: str) -> None:
        """A job named code outside the allow-list: counted by what it named (task, strategy, trainer)."""
        self.code_refused.labels(what if what in CODE_KINDS else "task").inc()

    def refused(self, limit: str) -> None:
        """A job refused or failed for passing `limit` (one of JOB_LIMITS)."""
        self.jobs_refused.labels(limit if limit in JOB_LIMITS else "other").inc()

    def traffic(self, direction: str, size: int) -> None:
        """Hook for RabbitBus.on_traffic."""
        (self.bytes_published if direction == "published" else self.bytes_consumed).inc(size)

    def dead_letter_counts(self) -> dict[str, float]:
        """Non-zero dead-letter counts by reason (for tests and summaries)."""
        return _nonzero(self.messages_rejected, "reason")

    def rejected_update_counts(self) -> dict[str, float]:
        """Non-zero counts of client updates refused, by reason (for tests and summaries)."""
        return _nonzero(self.updates_rejected, "reason")

    def refused_counts(self) -> dict[str, float]:
        """Non-zero counts of jobs refused or failed by limit (for tests and summaries)."""
        return _nonzero(self.jobs_refused, "limit")

    def serve(self, port: int) -> None:
        """Expose /metrics on `port` (0: don't)."""
        if port:
            start_http_server(port, registry=self.registry)


def _nonzero(counter: Counter, label: str) -> dict[str, float]:
    """A labelled counter's non-zero totals by that label."""
    return {
        s.labels[label]: s.value
        for family in counter.collect() for s in family.samples
        if s.name.endswith("_total") and s.value
    }
