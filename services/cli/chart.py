"""A job's metrics against rounds as a figure, one line per metric; drawn without pyplot's global state."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from fedmq.services.cli.history import JobHistory, metric_names
from fedmq.services.cli.summary import flat

if TYPE_CHECKING:
    from matplotlib.figure import Figure

# Bytes on the wire: millions, on another scale than losses and accuracies. Plotted when named.
NOT_BY_DEFAULT = ("transport",)


def default_metrics(job: JobHistory) -> list[str]:
    """What a plot shows unless told: every metric but the transport counters (those if nothing else)."""
    names = metric_names(job.records)
    return [n for n in names if n.partition(".")[0] not in NOT_BY_DEFAULT] or names


def metrics_figure(job: JobHistory, metrics: Sequence[str]) -> Figure:
    """A line per metric ("source.name") over the rounds that report it; LookupError naming an unknown one."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    known = metric_names(job.records)
    unknown = [m for m in metrics if m not in known]
    if unknown:
        raise LookupError(f"job {job.job_id} reported no {', '.join(unknown)} (its metrics: "
                          f"{', '.join(known) or 'none'})")
    figure = Figure(figsize=(8, 5), dpi=100, layout="constrained")
    axes = figure.add_subplot()
    for name in metrics:
        points = [(int(r["round"]), v) for r in job.records if (v := flat(r).get(name)) is not None]
        axes.plot([p[0] for p in points], [p[1] for p in points], marker="o", markersize=3, label=name)
    axes.set_xlabel("round")
    names = {m.partition(".")[2] for m in metrics}
    axes.set_ylabel(names.pop() if len(names) == 1 else "value")  # "accuracy" when it is all one measure
    axes.set_title(job.title())
    axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    axes.grid(alpha=0.3)
    if metrics:
        axes.legend()
    return figure
