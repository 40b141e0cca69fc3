"""`fedmq model`: a job's global model downloaded through the broker is the aggregator's, bit for bit."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

import fedmq
from fedmq.common.bus import topology
from fedmq.common.bus.base import Bus
from fedmq.common.bus.rabbitmq import RabbitBus
from fedmq.common.checkpoint import load_state
from fedmq.common.jobspec import JobSpec
from fedmq.common.messages import JobSubmit, to_wire
from fedmq.common.settings import Settings
from fedmq.services.aggregator.store import JobStore
from fedmq.services.cli.embedded import EmbeddedCluster, new_job_id
from fedmq.services.cli.follow import JobFollower
from fedmq.services.cli.history import Which
from fedmq.services.cli.main import app
from fedmq.services.cli.remote import Remote
from fedmq.services.cli.results import download
from tests.conftest import assert_bit_identical, small_job
from tests.integration.conftest import Transport
from tests.rabbit import fresh_vhost


@contextmanager
def finished_job(
    settings: Settings, spec: JobSpec, connect: Callable[[str], Bus]
) -> Iterator[tuple[EmbeddedCluster, Remote, str]]:
    """A cluster whose services are still up after `spec` completed, and a Remote on its bus."""
    job_id = new_job_id(spec)
    with EmbeddedCluster(settings, connect=connect) as cluster:
        follower = JobFollower(cluster.connect("cli"), job_id).start()
        try:
            follower.bus.publish(topology.SCHEDULER, to_wire(JobSubmit(job_id=job_id, spec=spec.model_dump(
                mode="json"))))
            assert [e.kind for e in follower.events(idle_timeout=60)][-1] == "completed"
            with Remote(settings, bus=follower.bus) as remote:
                yield cluster, remote, job_id
        finally:
            follower.close()


def test_the_final_best_and_any_rounds_model_download_bit_for_bit(
    transport: Transport, tmp_path: Path
) -> None:
    spec = small_job(rounds=2, objective={"metric": "server.accuracy", "mode": "max"})
    with finished_job(transport.settings, spec, transport.connect) as (_, remote, job_id):
        store = JobStore(transport.settings.state_dir / "aggregator", job_id)
        _, record, path = download(remote, job_id, "final", tmp_path / "final.safetensors")
        weights, metadata = load_state(path)
        kept, kept_metadata = load_state(store.root / "model.safetensors")
        assert_bit_identical(weights, kept)
        assert record["round"] == 2 and metadata == kept_metadata  # the spec, job id, round and metrics
        model = fedmq.load_model(str(path))
        assert_bit_identical(model.state_dict(), kept)

        job = remote.status("job", job_id).jobs[0]
        best = job["best"]
        _, record, path = download(remote, job_id, "best", tmp_path / "best.safetensors")
        assert record["round"] == best["round"]
        assert_bit_identical(load_state(path)[0], store.load_weights(best["model_digest"]))
        _, record, path = download(remote, job_id, 1, tmp_path / "round-1.safetensors")
        assert_bit_identical(load_state(path)[0], store.load_weights(job["history"][1]["model_digest"]))
        assert load_state(path)[1]["fedmq.round"] == "1"


def test_a_pruned_round_an_unknown_one_an_unknown_job_and_a_silent_aggregator_each_say_so(
    transport: Transport, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    settings = transport.settings.model_copy(update={"keep_checkpoints": 1, "request_timeout_s": 1.0})
    with finished_job(settings, small_job(rounds=3), transport.connect) as (cluster, remote, job_id):
        store = JobStore(settings.state_dir / "aggregator", job_id)
        history = remote.status("job", job_id).jobs[0]["history"]
        pruned = [h["round"] for h in history if store.find_weights(h["model_digest"]) is None]
        assert pruned, "FEDMQ_KEEP_CHECKPOINTS=1 keeps the last round and the best only"

        def refused(which: Which, job: str = job_id, out: Path = tmp_path / "m.safetensors") -> tuple[
                int, str]:
            with pytest.raises(typer.Exit) as exit_:
                download(remote, job, which, out)
            return exit_.value.exit_code, " ".join(capsys.readouterr().err.split())

        code, said = refused(pruned[0])
        assert code == 1 and f"no longer keeps round {pruned[0]}'s model" in said, said
        code, said = refused(9)
        assert code == 2 and "has no round 9 (rounds 0 to 3)" in said, said
        code, said = refused("final", "nobody-1234")
        assert code == 2 and "no job 'nobody-1234'; `fedmq status` lists the jobs" in said, said
        (tmp_path / "a-file").write_text("")
        code, said = refused("final", out=tmp_path / "a-file" / "model.safetensors")
        assert code == 1 and "cannot write" in said and "a-file" in said, said
        cluster.aggregator.bus.stop()
        code, said = refused("final")
        assert code == 3 and "no aggregator answered within 1s" in said, said
        assert not (tmp_path / "m.safetensors").exists()


@pytest.mark.rabbitmq
def test_a_deployments_job_downloads_and_plots_with_nothing_but_the_broker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CLI as a user on another machine runs it; the model (77 KB) crosses in 64 KiB chunks."""
    with fresh_vhost() as url:
        settings = Settings(broker_url=url, state_dir=tmp_path / "state", log_format="json",
                            frame_bytes=64 * 1024)
        spec = small_job(rounds=1, task__options__model={"name": "mlp", "hidden": [256]})
        with finished_job(settings, spec, lambda name: RabbitBus(settings, name)) as (_, _, job_id):
            monkeypatch.setenv("FEDMQ_BROKER_URL", url)
            monkeypatch.chdir(tmp_path)
            result = CliRunner().invoke(app, ["model", job_id])
            assert result.exit_code == 0, result.output
            path = tmp_path / f"{job_id}.safetensors"
            said = " ".join(result.output.split())
            assert f"round 1 of job {job_id} (the last round) saved to {path.name}" in said, said
            kept = load_state(settings.state_dir / "aggregator" / job_id / "model.safetensors")[0]
            assert sum(t.numel() * t.element_size() for t in kept.values()) > 64 * 1024
            assert_bit_identical(load_state(path)[0], kept)
            assert_bit_identical(fedmq.load_model(str(path)).state_dict(), kept)
            assert CliRunner().invoke(app, ["model", job_id, "--best", "--round", "1"]).exit_code == 2

            result = CliRunner().invoke(app, ["plot", job_id, "--csv", "rounds.csv"])
            assert result.exit_code == 0, result.output
            assert (tmp_path / f"{job_id}.png").stat().st_size > 0
            assert [row.split(",")[0] for row in (tmp_path / "rounds.csv").read_text().splitlines()] == [
                "round", "0", "1"]
