"""`fedmq status` on an 80-column terminal: job ids whole, so they can be copied."""

from __future__ import annotations

from rich.console import Console

from fedmq.services.cli.remote import jobs_table


def test_job_ids_are_never_cut_at_80_columns() -> None:
    ids = ["digits-fedavg-with-a-rather-long-name-90430b20", "regression-3f2a9c1d"]
    jobs = [{"job_id": job_id, "status": "completed", "round": 30, "rounds": 30, "reason": "x " * 40,
             "metrics": {"server": {"accuracy": 0.9666}}, "objective": {"metric": "server.accuracy"}}
            for job_id in ids]
    console = Console(width=80, record=True)
    console.print(jobs_table(jobs))
    text = console.export_text()
    for job_id in ids:
        assert job_id in text, text
