"""The console's web app (Starlette, server-rendered pages) and `main`, which serves it with uvicorn.

    /                jobs: `fedmq status`, live             /learners   `fedmq learners`, live
    /jobs/ID         rounds, chart, failures; cancel,       /groups     DDP groups, live
                     download (final, best)                 /submit     paste or upload a spec
    /fragments/...   the live parts, fetched every few seconds by static/console.js

It asks the scheduler and the aggregator through the broker, as the CLI does (services.cli.remote,
with the CLI's broker user), and sends what `fedmq submit` and `fedmq cancel` send after the same
checks. It keeps nothing of its own but login sessions, in memory.
"""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import quote

import jinja2
import structlog
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.middleware import Middleware
from starlette.middleware.base import BaseHTTPMiddleware
from starlette.requests import Request
from starlette.responses import FileResponse, PlainTextResponse, RedirectResponse, Response
from starlette.routing import Mount, Route
from starlette.staticfiles import StaticFiles
from starlette.templating import Jinja2Templates

from fedmq.common.errors import FedmqError, StateUnwritable
from fedmq.common.settings import Settings
from fedmq.services.cli.app import EXIT_UNREACHABLE
from fedmq.services.cli.remote import Remote, job_row, round_cells
from fedmq.services.console import pages
from fedmq.services.console.auth import COOKIE, FAILED_LOGIN_DELAY_S, Gate, guard, login_response, safe_next

log = structlog.get_logger("fedmq.console")

HERE = Path(__file__).parent
REFRESH_S = 2  # how often an open page asks for its live parts
STATUS_TIMEOUT_S = 5.0  # a page waits this long for the scheduler (a thread of the pool waits with it)
MAX_SPEC_UPLOAD = 256 * 1024  # a pasted or uploaded spec; the spec limits refuse far smaller ones anyway


def create_app(settings: Settings, remote: Remote, token: str, project: Path | None = None) -> Starlette:
    """The console over a connected `remote`; `project`: the folder whose code a submitted spec may
    name besides FEDMQ_ALLOWED_CODE's (default: the working directory)."""
    hosts = [*settings.console_allowed_hosts.split(","), settings.console_host]
    gate = Gate(token, hosts=[h for h in hosts if h not in ("0.0.0.0", "::")],
                secure_cookie=settings.console_secure_cookie)
    folder = project or Path.cwd()
    # A key a reply lacks (an older scheduler's) renders as nothing; `number` shows what is no number as -.
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True)
    env.filters["number"] = pages.number
    env.filters["part"] = lambda text: quote(str(text), safe="")  # a job id as one path segment
    templates = Jinja2Templates(env=env)

    def page(request: Request, name: str, status_code: int = 200, **context: Any) -> Response:
        session = gate.session(request)
        said: list[str] = []
        if session is not None and not request.url.path.startswith("/fragments/"):  # a whole page
            said = session.take_said()
        return templates.TemplateResponse(request, name, {
            "csrf": session.csrf if session else "", "refresh_s": REFRESH_S, "said": said, **context,
        }, status_code=status_code)

    def say(request: Request, line: str | None) -> None:
        """A line the next page shows once, to this session (an action's outcome)."""
        session = gate.session(request)
        if session is not None and line:
            session.say(line)

    def failed(request: Request, exc: FedmqError, status_code: int = 503) -> Response:
        return page(request, "error.html", status_code=status_code, message=str(exc))

    # -- reading: the scheduler's status ---------------------------------------------------------

    def jobs_context() -> dict[str, Any]:
        reply = remote.status("jobs", timeout=STATUS_TIMEOUT_S)
        return {"fleet": reply.fleet, "rows": [job_row(job) for job in reply.jobs]}

    def job_context(job_id: str) -> dict[str, Any] | None:
        reply = remote.status("job", job_id, timeout=STATUS_TIMEOUT_S)
        if reply.error or not reply.jobs:
            return None
        job = reply.jobs[0]
        header, rows = round_cells(job.get("history") or [])
        return {"job": job, "header": header, "rounds": rows[::-1], "failures": pages.failures(job),
                "has_best": job.get("best") is not None}

    def jobs_page(request: Request) -> Response:
        return _read(request, "live.html", jobs_context, title="Jobs", part="jobs")

    def jobs_fragment(request: Request) -> Response:
        return _read(request, "_jobs.html", jobs_context)

    def job_page(request: Request) -> Response:
        return _job(request, "job.html")

    def job_fragment(request: Request) -> Response:
        return _job(request, "_job.html")

    def _job(request: Request, name: str) -> Response:
        job_id = request.path_params["job_id"]
        try:
            context = job_context(job_id)
        except FedmqError as exc:
            return failed(request, exc)
        if context is None:
            return page(request, "error.html", status_code=404, message=f"no job {job_id!r}")
        return page(request, name, **context)

    def chart(request: Request) -> Response:
        job_id = request.path_params["job_id"]
        try:
            reply = remote.status("job", job_id, timeout=STATUS_TIMEOUT_S)
        except FedmqError as exc:
            return PlainTextResponse(str(exc), status_code=503)
        if reply.error or not reply.jobs:
            return PlainTextResponse(reply.error or f"no job {job_id!r}", status_code=404)
        png = pages.chart_png(reply.jobs[0])
        if png is None:
            return PlainTextResponse("no rounds yet", status_code=404)
        return Response(png, media_type="image/png")

    def model(request: Request) -> Response:
        from fedmq.services.cli.results import Unfetchable, fetch_model, save_fetched

        job_id = request.path_params["job_id"]
        try:
            which = pages.which_model(request.query_params.get("which", "final"))
        except ValueError as exc:
            return PlainTextResponse(str(exc), status_code=400)
        try:
            _, record, weights, spec_json = fetch_model(remote, job_id, which)
        except Unfetchable as exc:  # no such job or round, a pruned model: 404; no aggregator: 503
            return page(request, "error.html", status_code=503 if exc.code == EXIT_UNREACHABLE else 404,
                        message=str(exc))
        except (FedmqError, ConnectionError) as exc:  # the broker went away while it asked
            return page(request, "error.html", status_code=503, message=str(exc))
        except ValueError as exc:  # a scheduler's answer without the job's rounds (an older one)
            return page(request, "error.html", status_code=503, message=f"the scheduler's answer: {exc}")
        folder = tempfile.mkdtemp(prefix="fedmq-console-")
        path = Path(folder) / "model.safetensors"
        try:
            save_fetched(path, job_id, record, weights, spec_json)
        except StateUnwritable as exc:
            shutil.rmtree(folder, ignore_errors=True)
            return page(request, "error.html", status_code=503, message=str(exc))
        except BaseException:
            shutil.rmtree(folder, ignore_errors=True)
            raise
        del weights
        log.info("model_downloaded", job_id=job_id, round=record["round"], bytes=path.stat().st_size)
        which_round = {"x-fedmq-model-digest": str(record["model_digest"]),
                       "x-fedmq-round": str(record["round"])}
        return FileResponse(  # streamed from the file, which goes once it is sent
            path, media_type="application/octet-stream", filename=pages.file_name(job_id, which),
            headers=which_round,
            background=BackgroundTask(shutil.rmtree, folder, ignore_errors=True),
        )

    def learners_context() -> dict[str, Any]:
        reply = remote.status("learners", timeout=STATUS_TIMEOUT_S)
        return {"fleet": reply.fleet, "learners": reply.learners}

    def learners_page(request: Request) -> Response:
        return _read(request, "live.html", learners_context, title="Learners", part="learners")

    def learners_fragment(request: Request) -> Response:
        return _read(request, "_learners.html", learners_context)

    def groups_context() -> dict[str, Any]:
        jobs = remote.status("jobs", timeout=STATUS_TIMEOUT_S).jobs
        return {"groups": [job for job in jobs if job.get("ddp") is not None]}

    def groups_page(request: Request) -> Response:
        return _read(request, "live.html", groups_context, title="DDP groups", part="groups")

    def groups_fragment(request: Request) -> Response:
        return _read(request, "_groups.html", groups_context)

    def _read(request: Request, name: str, context: Any, **more: Any) -> Response:
        try:
            return page(request, name, **context(), **more)
        except FedmqError as exc:
            return failed(request, exc)

    # -- acting: submit, cancel -----------------------------------------------------------------

    def submit_page(request: Request) -> Response:
        return page(request, "submit.html", text="", lines=[], general=[])

    async def submit(request: Request) -> Response:
        length = request.headers.get("content-length", "")  # a browser's form always says its length
        if not length.isdigit():
            return page(request, "error.html", status_code=411, message="send the form with its length")
        if int(length) > 2 * MAX_SPEC_UPLOAD:  # before it is read
            return page(request, "error.html", status_code=413,
                        message=f"a job spec is at most {MAX_SPEC_UPLOAD} bytes")
        async with request.form(max_files=1, max_fields=8, max_part_size=MAX_SPEC_UPLOAD) as form:
            refused = gate.check_action(request, form)
            if refused:
                return page(request, "error.html", status_code=403, message=refused)
            text = await _spec_text(form)
        if text is None:
            return page(request, "submit.html", status_code=400, text="", lines=[],
                        general=[f"the spec must be UTF-8 text of at most {MAX_SPEC_UPLOAD} bytes"])
        spec, found = await run_in_threadpool(pages.check_text, text, settings, folder)
        if spec is None:
            return page(request, "submit.html", status_code=400, text=text,
                        lines=pages.annotated_lines(text, found), general=pages.listed(found))
        try:
            job_id, warning = await run_in_threadpool(_send_job, remote, spec)
        except FedmqError as exc:
            return failed(request, exc)
        log.info("job_submitted", job_id=job_id, name=spec.name)
        say(request, f"submitted {job_id}")
        say(request, warning and f"warning: {warning}")
        return RedirectResponse(f"/jobs/{quote(job_id, safe='')}", status_code=303)

    async def cancel(request: Request) -> Response:
        job_id = request.path_params["job_id"]
        async with request.form(max_files=0, max_fields=4) as form:
            refused = gate.check_action(request, form)
        if refused:
            return page(request, "error.html", status_code=403, message=refused)
        try:
            said = await run_in_threadpool(_cancel_job, remote, job_id)
        except FedmqError as exc:
            return failed(request, exc)
        log.info("job_cancel", job_id=job_id, said=said)
        say(request, said)
        return RedirectResponse(f"/jobs/{quote(job_id, safe='')}", status_code=303)

    # -- logging in and out ---------------------------------------------------------------------

    def login_page(request: Request) -> Response:
        return page(request, "login.html", next=safe_next(request.query_params.get("next")), wrong=False)

    async def login(request: Request) -> Response:
        async with request.form(max_files=0, max_fields=4) as form:
            given, target = form.get("token"), form.get("next")
        if isinstance(given, str) and gate.token_ok(given):
            log.info("console_login", client=request.client.host if request.client else "")
            return login_response(gate, request, target if isinstance(target, str) else "/")
        log.warning("console_login_refused", client=request.client.host if request.client else "")
        await asyncio.sleep(FAILED_LOGIN_DELAY_S)
        return page(request, "login.html", status_code=401,
                    next=safe_next(target if isinstance(target, str) else None), wrong=True)

    async def logout(request: Request) -> Response:
        async with request.form(max_files=0, max_fields=4) as form:
            refused = gate.check_action(request, form)
        if refused:
            return page(request, "error.html", status_code=403, message=refused)
        gate.close(request.cookies.get(COOKIE, ""))
        response = RedirectResponse("/login", status_code=303)
        response.delete_cookie(COOKIE, path="/")
        return response

    def healthz(request: Request) -> Response:
        return PlainTextResponse("ok")

    routes = [
        Route("/", jobs_page),
        Route("/fragments/jobs", jobs_fragment),
        Route("/jobs/{job_id}", job_page),
        Route("/fragments/jobs/{job_id}", job_fragment),
        Route("/jobs/{job_id}/chart.png", chart),
        Route("/jobs/{job_id}/model", model),
        Route("/jobs/{job_id}/cancel", cancel, methods=["POST"]),
        Route("/learners", learners_page),
        Route("/fragments/learners", learners_fragment),
        Route("/groups", groups_page),
        Route("/fragments/groups", groups_fragment),
        Route("/submit", submit_page),
        Route("/submit", submit, methods=["POST"]),
        Route("/login", login_page),
        Route("/login", login, methods=["POST"]),
        Route("/logout", logout, methods=["POST"]),
        Route("/healthz", healthz),
        Mount("/static", StaticFiles(directory=HERE / "static"), name="static"),
    ]
    return Starlette(routes=routes, middleware=[Middleware(BaseHTTPMiddleware, dispatch=guard(gate))])


async def _spec_text(form: Any) -> str | None:
    """The spec from the form: an uploaded file if one came, else the pasted text; None if unreadable."""
    upload = form.get("file")
    if isinstance(upload, UploadFile) and upload.filename:
        data = await upload.read(MAX_SPEC_UPLOAD + 1)
    else:
        pasted = form.get("spec")
        data = pasted.encode("utf-8") if isinstance(pasted, str) else b""
    if len(data) > MAX_SPEC_UPLOAD:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


def _send_job(remote: Remote, spec: Any) -> tuple[str, str | None]:
    """What `fedmq submit` sends once the spec is checked: the job id and the learners' warning."""
    from fedmq.services.cli.embedded import new_job_id

    job_id = new_job_id(spec)
    return job_id, remote.submit(spec, job_id)


def _cancel_job(remote: Remote, job_id: str) -> str:
    """`fedmq cancel`, from the console: what happened, in a line."""
    from fedmq.services.cli.remote import UnknownJob

    try:
        not_sent = remote.cancel(job_id, reason="cancelled from the console")
    except UnknownJob as exc:
        return str(exc)
    return not_sent or f"cancel requested for {job_id}"


def main(settings: Settings) -> None:
    """`fedmq console`: connect as the CLI does, then serve until interrupted. ConfigError without a token."""
    import uvicorn

    token = settings.console_token_value()
    with Remote(settings, name="fedmq-console") as remote:
        app = create_app(settings, remote, token)
        log.info("console_listening", url=f"http://{settings.console_host}:{settings.console_port}")
        uvicorn.run(app, host=settings.console_host, port=settings.console_port, log_level="warning",
                    proxy_headers=False, server_header=False)
