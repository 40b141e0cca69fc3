"""The web console in headless Chromium (Debian's package, driven by Playwright), against a real
RabbitMQ with the services running: log in, submit digits, watch it end, check its accuracy against
`fedmq status --json`, download its model by digest, cancel a second job, see a bad spec's errors on
their lines, and be refused without the token.

FEDMQ_CONSOLE_SCREENSHOTS=DIR: a PNG of each page goes there (the issue's note shows them).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import uvicorn
from typer.testing import CliRunner

from fedmq.common.allowlist import AllowList
from fedmq.common.bus.rabbitmq import RabbitBus
from fedmq.common.checkpoint import load_state
from fedmq.common.codec.state import state_digest
from fedmq.common.settings import Settings
from fedmq.services.cli.embedded import EmbeddedCluster
from fedmq.services.cli.main import app as cli
from fedmq.services.cli.remote import Remote
from fedmq.services.console.app import create_app
from tests.ci import under_ci
from tests.rabbit import fresh_vhost

pytestmark = [pytest.mark.rabbitmq, pytest.mark.slow]

if TYPE_CHECKING:
    from playwright.sync_api import Page

REPO = Path(__file__).resolve().parents[2]
TOKEN = "console-test-token-0123456789"
JOB_S = 240_000  # ms a digits job may take to complete on a loaded 2-core machine


def chromium() -> str:
    """Debian's chromium (`make test` installs it as root); skip loudly without it, fail under CI."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        why = "no chromium on PATH: apt-get install chromium (scripts/ensure-tools.sh does as root)"
        if under_ci():
            pytest.fail(why)
        pytest.skip(why)
    return found


@dataclass
class Console:
    url: str
    broker_url: str


@pytest.fixture
def console(tmp_path: Path) -> Iterator[Console]:
    with fresh_vhost() as url:
        settings = Settings(broker_url=url, state_dir=tmp_path / "state", log_format="json")
        allowed = AllowList.project(settings.allowed_prefixes, spec_dir=REPO)  # examples.ddp:main
        with EmbeddedCluster(settings, learners=2, connect=lambda name: RabbitBus(settings, name),
                             allowed=allowed), \
                Remote(settings, name="fedmq-console") as remote:
            app = create_app(settings, remote, TOKEN, project=REPO)
            server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
            thread = threading.Thread(target=server.run, name="console", daemon=True)
            thread.start()
            try:
                while not server.started:
                    assert thread.is_alive(), "the console's server did not start"
                    thread.join(0.05)
                port = server.servers[0].sockets[0].getsockname()[1]
                yield Console(f"http://127.0.0.1:{port}", url)
            finally:
                server.should_exit = True
                thread.join(10)


def test_the_console_submits_watches_downloads_cancels_and_refuses(
    console: Console, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from playwright.sync_api import expect, sync_playwright

    shots = os.environ.get("FEDMQ_CONSOLE_SCREENSHOTS")

    def shot(page: Page, name: str) -> None:
        if shots:
            Path(shots).mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(Path(shots) / f"{name}.png"), full_page=True)

    digits = (REPO / "examples" / "digits.yaml").read_text()
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium(), headless=True)
        context = browser.new_context(accept_downloads=True)
        page = context.new_page()

        # Refused without the token: a page sends to the login, a fragment and a download say 401.
        for path in ("/fragments/jobs", "/jobs/any/model?which=final"):
            assert context.request.get(console.url + path).status == 401
        page.goto(console.url + "/learners")
        expect(page).to_have_url(re.compile(r"/login\?next=/learners$"))
        page.fill("input[name=token]", "not-the-token")
        page.click("button[type=submit]")
        expect(page.locator("#login-error")).to_be_visible()
        shot(page, "login")
        page.fill("input[name=token]", TOKEN)
        page.click("button[type=submit]")
        expect(page).to_have_url(console.url + "/learners")
        expect(page.locator("table.learners tbody tr")).to_have_count(2)
        shot(page, "learners")

        # A bad spec: each error beside its line, and nothing sent.
        bad = digits.replace("lr: 0.05", "lr: -1").replace("rounds: 30", "rounds: 30\nrouns: 3")
        page.goto(console.url + "/submit")
        page.fill("#spec", bad)
        page.click("#submit")
        lines = bad.splitlines()
        lr_line = next(n for n, line in enumerate(lines, 1) if "lr: -1" in line)
        typo_line = lines.index("rouns: 3") + 1
        expect(page.locator(f'.error[data-line="{lr_line}"]')).to_contain_text("train.lr")
        expect(page.locator(f'.error[data-line="{typo_line}"]')).to_contain_text("unknown key")
        shot(page, "submit-errors")

        # digits, uploaded as the file: watched live until it completes.
        page.goto(console.url + "/submit")
        shot(page, "submit")
        page.set_input_files("input[type=file]", str(REPO / "examples" / "digits.yaml"))
        page.click("#submit")
        expect(page).to_have_url(re.compile(r"/jobs/digits-fedavg-"))
        job_id = page.url.rsplit("/", 1)[1].split("?")[0]
        expect(page.locator("#job-status")).to_have_text("completed", timeout=JOB_S)
        page.reload()
        shot(page, "job")
        shown = page.locator('[data-metric="server.accuracy"]').inner_text()

        monkeypatch.setenv("FEDMQ_BROKER_URL", console.broker_url)
        status = CliRunner().invoke(cli, ["status", job_id, "--json"])
        assert status.exit_code == 0, status.output
        job = json.loads(status.stdout)[0]
        assert shown == f"{job['metrics']['server']['accuracy']:.4f}"
        assert job["status"] == "completed" and len(job["history"]) == 31

        # The final model, downloaded: its tensors hash to the last round's digest.
        with page.expect_download() as download:
            page.click("#download-final")
        saved = tmp_path / download.value.suggested_filename
        download.value.save_as(saved)
        assert saved.name == f"{job_id}.safetensors"
        weights, metadata = load_state(saved)
        assert state_digest(weights) == job["history"][-1]["model_digest"]
        assert json.loads(metadata["fedmq.job_id"]) == job_id

        page.goto(console.url + "/")
        expect(page.locator(f'tr[data-job="{job_id}"] .status')).to_have_text("completed")
        shot(page, "jobs")

        # A second job, cancelled from its page.
        page.goto(console.url + "/submit")
        page.fill("#spec", digits.replace("rounds: 30", "rounds: 5000"))
        page.click("#submit")
        expect(page).to_have_url(re.compile(r"/jobs/digits-fedavg-"))
        expect(page.locator("#job-status")).to_have_text("running")
        page.click("#cancel")
        expect(page.locator("[data-said]")).to_contain_text("cancel requested")
        expect(page.locator("#job-status")).to_have_text("cancelled", timeout=60_000)
        expect(page.locator("#job-reason")).to_contain_text("cancelled from the console")
        shot(page, "job-cancelled")

        # A DDP job: its group, ranks, master and backend, while it runs, then its end.
        ddp = (REPO / "examples" / "ddp.yaml").read_text()
        ddp = ddp.replace("master_port: 29500", f"master_port: {free_port()}")
        ddp = ddp.replace("seed: 0}", "seed: 0, epoch_pause_s: 1.0}")
        page.goto(console.url + "/submit")
        page.fill("#spec", ddp)
        page.click("#submit")
        expect(page).to_have_url(re.compile(r"/jobs/digits-ddp-"))
        ddp_id = page.url.rsplit("/", 1)[1].split("?")[0]
        page.goto(console.url + "/groups")
        group = page.locator("section.group", has=page.locator(f'a[href="/jobs/{ddp_id}"]'))
        expect(group.locator("table.members tbody tr")).to_have_count(2, timeout=60_000)
        expect(group.locator("table.members tbody tr").first.locator("td").first).to_have_text("0")
        expect(group.locator("dd.backend")).to_have_text("gloo")
        shot(page, "groups")
        expect(group.locator(".status")).to_have_text("completed", timeout=JOB_S)
        browser.close()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
