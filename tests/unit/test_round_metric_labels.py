"""fedmq_round_metric keeps its label values bounded, whatever names clients and rounds report."""

from __future__ import annotations

from fedmq.common.metrics import Metrics
from fedmq.common.task.metrics import MAX_NAMES


def exported(metrics: Metrics) -> dict[tuple[str, str, str], float]:
    return {
        (s.labels["fl_job"], s.labels["source"], s.labels["name"]): s.value
        for family in metrics.registry.collect()
        if family.name == "fedmq_round_metric"
        for s in family.samples
    }


def test_a_round_exports_at_most_the_name_bound_per_source() -> None:
    metrics = Metrics()
    per_class = {f"recall_{c:03d}": c / 100 for c in range(100)}  # union over non-IID clients
    metrics.round_metrics("job", {"train": per_class, "server": {"accuracy": 0.9}})
    series = exported(metrics)
    assert len([k for k in series if k[1] == "train"]) == MAX_NAMES
    assert series[("job", "train", "recall_000")] == 0.0 and series[("job", "server", "accuracy")] == 0.9


def test_names_a_later_round_no_longer_reports_are_removed() -> None:
    metrics = Metrics()
    for server_round in range(50):  # a Task naming a metric after its round
        metrics.round_metrics("job", {"train": {"loss": 1.0, f"round_{server_round}": 1.0}})
    metrics.round_metrics("job", {"server": {"accuracy": 0.5}})  # another source leaves train alone
    assert sorted(exported(metrics)) == [
        ("job", "server", "accuracy"), ("job", "train", "loss"), ("job", "train", "round_49")
    ]


def test_unknown_sources_and_bad_names_are_not_exported() -> None:
    metrics = Metrics()
    metrics.round_metrics("job", {"made_up": {"x": 1.0}, "train": {"bad name!": 1.0, "ok": 2.0}})
    assert sorted(exported(metrics)) == [("job", "train", "ok")]
