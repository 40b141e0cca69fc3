"""`fedmq console` over the in-memory bus (Starlette's test client): who may see and do what, how a
spec's problems are placed on its lines, and a job submitted, shown, charted and downloaded.
tests/integration/test_console_browser.py drives it in a browser over RabbitMQ."""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from starlette.testclient import TestClient
from typer.testing import CliRunner

from fedmq.common.checkpoint import load_state
from fedmq.common.codec.state import state_digest
from fedmq.common.errors import ConfigError
from fedmq.common.messages import Message, StatusReply
from fedmq.common.settings import Settings
from fedmq.services.cli.embedded import EmbeddedCluster
from fedmq.services.cli.main import app as cli
from fedmq.services.cli.remote import Remote, SchedulerSilent
from fedmq.services.console.app import create_app
from fedmq.services.console.auth import safe_next
from fedmq.services.console.pages import check_text, key_lines, nearest, problems
from tests.conftest import REPO, shard_size, small_job
from tests.integration import train_plugins

TOKEN = "a-test-token-of-some-length"
PAGE = {"accept": "text/html"}


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    settings = Settings(state_dir=tmp_path / "state", log_format="json")
    with EmbeddedCluster(settings) as cluster:
        bus = cluster.connect("console")
        thread = threading.Thread(target=bus.run, daemon=True)
        thread.start()
        try:
            with Remote(settings, bus=bus) as remote:
                app = create_app(settings, remote, TOKEN, project=REPO)
                with TestClient(app, base_url="http://localhost") as c:
                    yield c
        finally:
            bus.stop()
            thread.join(5)


def log_in(client: TestClient) -> str:
    """Log in; the CSRF token the pages carry."""
    response = client.post("/login", data={"token": TOKEN, "next": "/submit"}, follow_redirects=True)
    assert response.status_code == 200 and response.url.path == "/submit"
    found = re.search(r'name="csrf" value="([^"]+)"', response.text)
    assert found is not None
    return found.group(1)


def spec_text(**changes: object) -> str:
    return yaml.safe_dump(small_job(**changes).model_dump(mode="json", exclude_defaults=True))


def test_nothing_but_the_login_page_without_the_token(client: TestClient) -> None:
    for path in ("/", "/jobs/x", "/learners", "/groups", "/submit"):
        response = client.get(path, headers=PAGE, follow_redirects=False)
        assert response.status_code == 303 and response.headers["location"].startswith("/login?next=")
    for path in ("/fragments/jobs", "/jobs/x/model", "/jobs/x/chart.png"):
        assert client.get(path).status_code == 401
    assert client.post("/submit", data={"spec": spec_text()}).status_code == 401
    wrong = client.post("/login", data={"token": TOKEN[:-1], "next": "/"})
    assert wrong.status_code == 401 and "not the console" in wrong.text
    assert "fedmq_console" not in wrong.cookies
    assert client.get("/fragments/jobs", headers={"authorization": f"Bearer {TOKEN}x"}).status_code == 401
    assert client.get("/fragments/jobs", headers={"authorization": f"Bearer {TOKEN}"}).status_code == 200
    assert client.get("/healthz").text == "ok"


def test_every_response_forbids_framing_and_foreign_scripts(client: TestClient) -> None:
    refused = [client.get(path) for path in ("/login", "/fragments/jobs", "/static/console.js")]
    log_in(client)
    shown = [client.get(path) for path in ("/", "/fragments/jobs", "/learners", "/submit", "/jobs/nope")]
    for response in refused + shown:
        policy = response.headers["content-security-policy"]
        assert "script-src 'self'" in policy and "frame-ancestors 'none'" in policy, response.url
        assert response.headers["x-frame-options"] == "DENY"
        assert response.headers["x-content-type-options"] == "nosniff"
        assert "<script>" not in response.text  # no inline script: the policy would block it anyway


def test_actions_need_the_sessions_csrf_token_and_our_origin(client: TestClient) -> None:
    csrf = log_in(client)
    text = spec_text()
    assert client.post("/submit", data={"spec": text}).status_code == 403
    assert client.post("/submit", data={"spec": text, "csrf": csrf + "x"}).status_code == 403
    foreign = client.post("/submit", data={"spec": text, "csrf": csrf}, headers={"origin": "http://evil.example"})
    assert foreign.status_code == 403 and "another site" in foreign.text
    assert client.post("/jobs/x/cancel", data={}).status_code == 403
    assert "No jobs yet" in client.get("/fragments/jobs").text  # nothing refused was sent
    sent = client.post("/submit", data={"spec": text, "csrf": csrf}, headers={"origin": "http://localhost"},
                       follow_redirects=False)
    assert sent.status_code == 303 and sent.headers["location"].startswith("/jobs/tiny-")
    client.post("/logout", data={"csrf": csrf})
    assert client.get("/fragments/jobs").status_code == 401  # the session is gone


def test_a_submitted_job_is_shown_charted_and_its_models_downloaded(
    client: TestClient, tmp_path: Path
) -> None:
    csrf = log_in(client)
    text = spec_text(objective={"metric": "server.accuracy", "mode": "max"})
    sent = client.post("/submit", data={"spec": text, "csrf": csrf}, follow_redirects=False)
    job_id = sent.headers["location"].removeprefix("/jobs/")
    deadline = time.monotonic() + 120
    while 'id="job-status" class="status completed"' not in client.get(f"/fragments/jobs/{job_id}").text:
        assert time.monotonic() < deadline, "the job did not complete"
        time.sleep(0.2)
    page = client.get(f"/jobs/{job_id}")
    assert page.status_code == 200 and "Download best model" in page.text and 'id="cancel"' not in page.text
    chart = client.get(f"/jobs/{job_id}/chart.png")
    assert chart.status_code == 200 and chart.content.startswith(b"\x89PNG")
    for which in ("final", "best"):
        model = client.get(f"/jobs/{job_id}/model", params={"which": which})
        assert model.status_code == 200
        name = f"{job_id}{'' if which == 'final' else '-best'}.safetensors"
        assert model.headers["content-disposition"] == f'attachment; filename="{name}"'
        path = tmp_path / name
        path.write_bytes(model.content)
        weights, _ = load_state(path)
        assert state_digest(weights) == model.headers["x-fedmq-model-digest"]
    assert client.get(f"/jobs/{job_id}/model", params={"which": "newest"}).status_code == 400
    assert client.get("/jobs/nope/model").status_code == 404
    assert client.get("/jobs/nope").status_code == 404
    cancel = client.post(f"/jobs/{job_id}/cancel", data={"csrf": csrf})
    assert "no longer running (completed)" in cancel.text


def test_text_a_spec_carries_is_shown_escaped(client: TestClient) -> None:
    csrf = log_in(client)
    text = spec_text() + "<script>alert(1)</script>: 1\n"
    response = client.post("/submit", data={"spec": text, "csrf": csrf})
    assert response.status_code == 400
    assert "<script>alert(1)</script>" not in response.text
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in response.text


def test_an_uploaded_spec_that_is_not_text_or_too_large_is_refused(client: TestClient) -> None:
    csrf = log_in(client)
    form = {"csrf": csrf}
    binary = client.post("/submit", data=form, files={"file": ("job.yaml", b"\xff\xfe", "text/yaml")})
    assert binary.status_code == 400 and "UTF-8 text" in binary.text
    large = client.post("/submit", data=form, files={"file": ("a.yaml", b"a" * 300_000, "text/yaml")})
    assert large.status_code in (400, 413)


def test_problems_are_placed_on_the_lines_they_are_about(tmp_path: Path) -> None:
    settings = Settings(state_dir=tmp_path)
    text = spec_text().replace("lr: 0.1", "lr: -0.1") + "strategy: {name: fedavgg}\n"
    spec, found = check_text(text, settings, REPO)
    assert spec is None
    lines = text.splitlines()
    by_line = {p.line: p.message for p in found}
    assert "train.lr" in by_line[next(n for n, line in enumerate(lines, 1) if "lr: -0.1" in line)]
    assert "fedavgg" in by_line[len(lines)]
    assert found[0].line is None and found[0].message.startswith("the spec has 2 problems")

    broken = "name: x\ntrain: {lr: 0.1\n"
    spec, found = check_text(broken, settings, REPO)
    assert spec is None and found[0].line is not None and "YAML" in found[0].message

    assert nearest(key_lines("a:\n  b:\n    - c: 1\n    - d: 2\n"), "a.b.1.d") == 4
    assert nearest(key_lines("a:\n  b: 1\n"), "a.x") == 1  # the nearest parent found
    assert problems("cannot read job spec the spec: No such file", "")[0].line is None

    spec, found = check_text(spec_text(), settings, REPO)
    assert spec is not None and found == []

    many = spec_text() + "".join(f"extra{n}: {n}\n" for n in range(300))  # parsed once, not once each
    spec, found = check_text(many, settings, REPO)
    assert spec is None and len(found) == 301
    assert [p.line for p in found[1:4]] == [len(spec_text().splitlines()) + n for n in (1, 2, 3)]
    assert sum(p.line is not None for p in found) == 200 and "shown beside" not in found[0].message


def test_only_paths_of_this_site_follow_a_login() -> None:
    assert safe_next("/jobs/a?x=1") == "/jobs/a?x=1"
    for bad in ("//evil.example/x", "https://evil.example", "/\\evil.example", "", None, "jobs"):
        assert safe_next(bad) == "/"


def test_the_console_needs_a_token_of_its_own(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="FEDMQ_CONSOLE_TOKEN_FILE"):
        Settings().console_token_value()
    with pytest.raises(ConfigError, match="at least 16"):
        Settings(console_token="short").console_token_value()
    token = tmp_path / "token"
    token.write_text(TOKEN + "\n")
    assert Settings(console_token_file=token).console_token_value() == TOKEN
    with pytest.raises(ConfigError, match="both"):
        Settings(console_token_file=token, console_token=TOKEN).console_token_value()
    empty = tmp_path / "empty"
    empty.write_text("")
    with pytest.raises(ConfigError, match="FEDMQ_CONSOLE_TOKEN_FILE=.*empty"):
        Settings(console_token_file=empty).console_token_value()

    unset: dict[str, str | None] = {"FEDMQ_CONSOLE_TOKEN": None, "FEDMQ_CONSOLE_TOKEN_FILE": None}
    refused = CliRunner().invoke(cli, ["console"], env=unset)
    assert refused.exit_code == 2 and "no default one" in refused.output


def test_only_our_host_names_are_answered(client: TestClient) -> None:
    rebound = client.get("/login", headers={"host": "attacker.example"})
    assert rebound.status_code == 421 and "FEDMQ_CONSOLE_ALLOWED_HOSTS" in rebound.text
    assert client.get("/login", headers={"host": "127.0.0.1:8080"}).status_code == 200


def test_a_new_login_ends_the_session_it_replaces(client: TestClient) -> None:
    log_in(client)
    old = client.cookies.get("fedmq_console")
    log_in(client)
    assert client.cookies.get("fedmq_console") != old
    assert client.get("/fragments/jobs").status_code == 200
    client.cookies.clear()
    client.cookies.set("fedmq_console", old or "")
    assert client.get("/fragments/jobs").status_code == 401


def test_a_submission_must_say_its_length_and_stay_small(client: TestClient) -> None:
    csrf = log_in(client)
    over = client.post("/submit", data={"csrf": csrf, "spec": "a" * (600 * 1024)})
    assert over.status_code == 413 and "at most" in over.text
    chunked = {"content-type": "application/x-www-form-urlencoded", "transfer-encoding": "chunked"}
    unsaid = client.post("/submit", content=b"csrf=x", headers=chunked)
    assert unsaid.status_code == 411


def test_a_csrf_token_that_is_not_ascii_is_refused_not_a_crash(client: TestClient) -> None:
    log_in(client)
    assert client.post("/jobs/x/cancel", data={"csrf": "é" * 43}).status_code == 403


def test_a_failed_clients_reason_round_and_phase_are_on_its_jobs_page(
    client: TestClient, tmp_path: Path
) -> None:
    csrf = log_in(client)
    spec = small_job(clients__min_fit=4, clients__on_error="drop_client", rounds=2,
                     task__name="tests.integration.train_plugins:Failing")
    train_plugins.FAIL_SIZE[0] = shard_size(spec, 0)
    try:
        text = yaml.safe_dump(spec.model_dump(mode="json", exclude_defaults=True))
        job_id = client.post("/submit", data={"spec": text, "csrf": csrf}, follow_redirects=False
                             ).headers["location"].removeprefix("/jobs/")
        deadline = time.monotonic() + 120
        while 'class="status completed"' not in (part := client.get(f"/fragments/jobs/{job_id}").text):
            assert time.monotonic() < deadline, "the job did not complete"
            time.sleep(0.2)
    finally:
        train_plugins.reset()
    failures = part[part.index("Failed clients"):part.index("<h2>Rounds")]
    rows = re.findall(r"<tr><td>(\d+)</td><td>(\d+)</td><td>(\w+)</td><td>([^<]*)</td></tr>", failures)
    assert [row[:3] for row in rows] == [("2", "0", "train"), ("1", "0", "train")]  # newest first
    assert all("RuntimeError: simulated out-of-memory" in row[3] for row in rows)
    assert "learners: 1 alive" in client.get("/learners").text


class Scripted(Remote):
    """A Remote whose scheduler answers what the test says (an older one, a silent one): what a page
    does with such answers, without a cluster. Its submit and cancel are Remote's own."""

    def __init__(self, jobs: list[dict], learners: list[dict], silent: bool = False) -> None:  # no bus
        self.jobs, self.learners, self.silent = jobs, learners, silent
        self.sent: list[Message] = []

    def status(self, what: str = "jobs", job_id: str = "", timeout: float = 10.0) -> StatusReply:
        if self.silent:
            raise SchedulerSilent("no scheduler answered")
        if what == "job":
            found = [j for j in self.jobs if j["job_id"] == job_id]
            return StatusReply(jobs=found, error=None if found else f"no job {job_id!r}")
        return StatusReply(jobs=self.jobs, learners=self.learners)

    def send(self, msg: Message) -> None:
        self.sent.append(msg)


def scripted_client(remote: Scripted, tmp_path: Path) -> TestClient:
    app = create_app(Settings(state_dir=tmp_path), remote, TOKEN, project=REPO)
    return TestClient(app, base_url="http://localhost")


MARKUP = '<img src=x onerror="alert(1)">'


def test_pages_take_an_older_schedulers_answers_and_escape_what_they_carry(tmp_path: Path) -> None:
    jobs: list[dict[str, Any]] = [  # the least a scheduler has sent; markup wherever text comes from outside
        {"job_id": "old-1", "status": "failed", "round": 2, "rounds": 5, "reason": MARKUP,
         "history": [{"round": 1, "metrics": {"server": {"accuracy": None}},
                      "failures": [{"client": 3, "phase": "train", "reason": MARKUP}]}]},
        {"job_id": "older-2", "status": "running", "metrics": {"server": {"accuracy": None}},
         "history": [{"round": 0, "seconds": None}]},  # no round, rounds or name; None where numbers go
        {"job_id": "ddp-1", "name": "d", "status": "completed", "round": 1, "rounds": 1,
         "ddp": {"attempt": 0, "members": [], "world_size": 2, "master_addr": "", "master_port": 29500,
                 "backend": "auto", "restarts_used": 0, "max_restarts": 0}},
    ]
    learners = [{"learner": MARKUP, "device": "cpu", "busy": False, "alive": True}]
    with scripted_client(Scripted(jobs, learners), tmp_path) as c:
        log_in(c)
        for path in ("/", "/fragments/jobs", "/jobs/old-1", "/fragments/jobs/old-1", "/jobs/older-2",
                     "/learners", "/groups"):
            page = c.get(path)
            assert page.status_code == 200, (path, page.text[-500:])
            assert MARKUP not in page.text, path
        assert "&lt;img src=x onerror=&#34;alert(1)&#34;&gt;" in c.get("/jobs/old-1").text
        assert "the group has ended (completed)" in c.get("/groups").text
        chart = c.get("/jobs/old-1/chart.png")  # the None is left out of the line, as `fedmq plot` does
        assert chart.status_code == 200 and chart.content.startswith(b"\x89PNG")
        assert c.get("/healthz", headers={"host": "10.1.2.3:8080"}).text == "ok"  # a probe, by address


def test_submit_sends_the_job_with_a_warning_when_no_scheduler_answers(tmp_path: Path) -> None:
    remote = Scripted([], [], silent=True)
    with scripted_client(remote, tmp_path) as c:
        csrf = log_in(c)
        sent = c.post("/submit", data={"spec": spec_text(), "csrf": csrf})
        assert [type(m).__name__ for m in remote.sent] == ["JobSubmit"]  # as `fedmq submit` does
        assert "no scheduler answered within 5 s" in sent.text
