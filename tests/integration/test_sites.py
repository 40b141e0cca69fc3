"""Sites on the in-memory bus: a job whose clients are named sites, each read from a data folder."""

from __future__ import annotations

from pathlib import Path

from examples.sites import SITES, write_sites
from fedmq.common.jobspec import load_job
from fedmq.common.settings import Settings
from fedmq.services.cli.embedded import run_job
from tests.conftest import REPO


def _spec(tmp_path: Path, rounds: int = 3) -> Path:
    spec = tmp_path / "sites.yaml"
    spec.write_text((REPO / "examples" / "sites.yaml").read_text().replace("rounds: 10", f"rounds: {rounds}"))
    return spec


def test_fedmq_run_plays_every_site_from_its_data_folder(tmp_path: Path) -> None:
    write_sites(tmp_path / "data", SITES)
    settings = Settings(state_dir=tmp_path / "state", data_dir=tmp_path / "data")
    result = run_job(load_job(_spec(tmp_path)), settings)
    assert result["status"] == "completed", result
    last = result["history"][-1]
    assert last["clients"] == len(SITES) and last["failed"] == 0 and "unserved_sites" not in last
    assert 0.0 < last["metrics"]["federated"]["accuracy"] <= 1.0


def test_sites_no_learner_hosts_are_dropped_clients_named_in_the_history(tmp_path: Path) -> None:
    hosted = SITES[:2]
    write_sites(tmp_path / "data", hosted, all_sites=SITES)  # the other sites' files are not here
    settings = Settings(state_dir=tmp_path / "state", data_dir=tmp_path / "data", sites=",".join(hosted))
    result = run_job(load_job(_spec(tmp_path)), settings)
    assert result["status"] == "completed", result  # min_fit 2: the hosted sites carry each round
    rounds = [record for record in result["history"] if record["round"] >= 1]
    assert len(rounds) == 3
    for record in rounds:
        assert record["clients"] == 2 and record["failed"] == 2
        assert record["unserved_sites"] == SITES[2:]
        assert sorted(f["phase"] for f in record["failures"]) == ["placement", "placement"]
