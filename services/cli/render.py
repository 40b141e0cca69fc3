"""Terminal output of the CLI: a progress bar over rounds and a closing summary."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from fedmq.common.messages import JobEvent
from fedmq.services.cli.summary import headline


class RoundProgress:
    """A rich progress bar fed with job events; silent when `enabled` is False."""

    def __init__(self, console: Console, enabled: bool = True) -> None:
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[metric]} [cyan]{task.fields[value]}[/]"),
            TimeElapsedColumn(),
            console=console,
            disable=not enabled,
            transient=False,
        )
        self.task = self.progress.add_task("rounds", total=None, metric="", value="")
        self.objective: str | None = None
        self.enabled = enabled  # off (--verbose): the services' logs say it all, lines included

    def __enter__(self) -> RoundProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()

    def start_job(
        self, name: str, rounds: int, done: Iterable[dict[str, Any]], objective: str | None = None,
        report: dict[str, Any] | None = None,
    ) -> None:
        """Begin from what a job has already done (watching a job that is under way); `report`:
        a running DDP job's latest (status's `report`)."""
        self.objective = objective
        self.progress.update(self.task, total=rounds, description=name)
        for record in done:
            self._show(record["round"], record)
        if report:
            self._show_report(report)

    def _show(self, server_round: int, data: dict[str, Any]) -> None:
        if data.get("reports"):  # a DDP job's one record: its steps are the progress
            self._show_report(data["reports"][-1])
            return
        shown = headline(data, self.objective)
        metric, value = (shown[0], f"{shown[1]:.4f}") if shown else ("", "")
        self.progress.update(self.task, completed=server_round, metric=metric, value=value)

    def _show_report(self, report: dict[str, Any]) -> None:
        shown = headline({"metrics": {"train": report.get("metrics", {})}}, self.objective)
        metric, value = (shown[0], f"{shown[1]:.4f}") if shown else ("", "")
        total = report.get("total")
        self.progress.update(self.task, completed=report["step"], metric=metric, value=value,
                             **({"total": total} if total else {}))

    def say(self, text: str) -> None:
        """A line above the bar (said once by whoever calls it: a note about the run)."""
        self.progress.console.print(text, highlight=False, markup=False, soft_wrap=True)

    def update(self, event: JobEvent) -> None:
        if event.kind == "accepted":
            self.objective = (event.data.get("objective") or {}).get("metric")
            self.progress.update(self.task, total=event.rounds, description=event.data.get("name", "rounds"))
        elif event.kind == "round_completed" and event.round is not None:
            self._show(event.round, event.data)
        elif event.kind == "progress":
            self._show_progress(event.data)

    def _show_progress(self, data: dict[str, Any]) -> None:
        """A DDP rank's output, each line above the bar, and rank 0's latest report on the bar."""
        rank = data.get("rank", "?")
        if self.enabled and data.get("dropped"):
            self.progress.console.print(f"[dim]rank {rank}[/] [yellow]({data['dropped']} lines dropped)[/]")
        for line in data.get("lines", []) if self.enabled else []:  # user text: brackets are not markup
            self.progress.console.print(f"[dim]rank {rank}[/] {escape(line)}", highlight=False,
                                        soft_wrap=True)
        if data.get("reports"):
            self._show_report(data["reports"][-1])


def print_summary(console: Console, result: dict[str, Any]) -> None:
    status = result["status"]
    mark = {"completed": "[green]✓[/]", "failed": "[red]✗[/]"}.get(status, "[yellow]![/]")
    console.print(
        f"{mark} [bold]{result['name']}[/] ({result['job_id']}) {status} after "
        f"{result.get('rounds', 0)} rounds in {result['wall_seconds']:.1f} s"
    )
    final, initial = result.get("final", {}), result.get("initial", {})
    objective, best = result.get("objective"), result.get("best")
    for name, value in final.items():
        before = f", initial {initial[name]:.4f}" if name in initial else ""
        console.print(f"  {name}: final [bold cyan]{value:.4f}[/]{before}")
    if objective and best:
        console.print(
            f"  best {objective['metric']} ({objective['mode']}): [bold]{best['value']:.4f}[/] "
            f"in round {best['round']}"
        )
        if result.get("best_model_path"):
            console.print(f"  best model saved to [bold]{result['best_model_path']}[/]", soft_wrap=True)
    elif objective and status == "completed":
        console.print(
            f"  [yellow]objective {objective['metric']} was never reported[/] (the job's metrics: "
            f"{', '.join(final) or 'none'}): no best round; fix objective.metric"
        )
    if result.get("reason"):
        console.print(f"  reason: {escape(result['reason'])}")  # user text: brackets are not markup
    if result.get("model_path"):
        # soft_wrap: a long path stays on one line, to be copied whole
        console.print(f"  model saved to [bold]{result['model_path']}[/]", soft_wrap=True)
        if result.get("ddp"):  # no Task to build the model with: the entry's own model class loads it
            console.print("  load its tensors with [bold]safetensors.torch.load_file(path)[/]")
        else:
            console.print("  load it with [bold]fedmq.load_model(path)[/] (safetensors)")
        artifacts = Path(result["model_path"]).parent / "artifacts"
        if artifacts.is_dir() and any(artifacts.iterdir()):
            console.print(f"  the Task's artifacts are in [bold]{artifacts}[/]", soft_wrap=True)
