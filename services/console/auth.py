"""The console's login and CSRF: one token logs in; a session cookie and a per-session CSRF token follow.

    GET page ─▶ session cookie? ─ no ─▶ 303 /login?next=page   (fragments, what no browser page asks: 401)
    POST /login token ─▶ equal to the setting's (constant time) ─▶ new session: cookie + CSRF token
    POST action ─▶ session cookie + form field `csrf` equal to the session's, Origin (if sent) ours
    `Authorization: Bearer TOKEN` ─▶ any request, no cookie, no CSRF (scripts: curl a model)

Sessions live in this process's memory only: a restarted console asks for the token again.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import quote, urlsplit

from starlette.requests import Request
from starlette.responses import PlainTextResponse, RedirectResponse, Response

COOKIE = "fedmq_console"
SESSION_S = 12 * 3600.0
MAX_SESSIONS = 1000  # the oldest goes past this: logins cannot grow the process without bound
FAILED_LOGIN_DELAY_S = 0.5  # each wrong token waits this long before its answer
PUBLIC = ("/login", "/static/", "/healthz")
SAID_KEPT = 20


@dataclass
class Session:
    csrf: str
    expires: float
    said: list[str] = field(default_factory=list)  # what the next page says once (an action's outcome)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def say(self, line: str) -> None:
        """Keep a line for the next page (the last SAID_KEPT of them)."""
        with self._lock:
            self.said = [*self.said, line][-SAID_KEPT:]

    def take_said(self) -> list[str]:
        with self._lock:
            said, self.said = self.said, []
        return said


class Gate:
    """Who may do what: the token, the sessions it opened, their CSRF tokens."""

    def __init__(self, token: str, hosts: Iterable[str] = ("localhost", "127.0.0.1", "::1"),
                 secure_cookie: bool = False) -> None:
        self._digest = hashlib.sha256(token.encode()).digest()
        self._sessions: dict[str, Session] = {}
        self.hosts = frozenset(h.strip().strip("[]").lower() for h in hosts if h.strip())
        self.secure_cookie = secure_cookie

    def token_ok(self, given: str) -> bool:
        return hmac.compare_digest(hashlib.sha256(given.encode("utf-8", "replace")).digest(), self._digest)

    def open(self) -> tuple[str, Session]:
        now = time.monotonic()
        for key in [k for k, s in self._sessions.items() if s.expires <= now]:
            del self._sessions[key]
        while len(self._sessions) >= MAX_SESSIONS:
            del self._sessions[next(iter(self._sessions))]
        key = secrets.token_urlsafe(32)
        session = self._sessions[key] = Session(csrf=secrets.token_urlsafe(32), expires=now + SESSION_S)
        return key, session

    def close(self, key: str) -> None:
        self._sessions.pop(key, None)

    def session(self, request: Request) -> Session | None:
        """The request's live session, from its cookie; None if it has none."""
        key = request.cookies.get(COOKIE, "")
        session = self._sessions.get(key)
        if session is None or session.expires <= time.monotonic():
            return None
        return session

    def bearer(self, request: Request) -> bool:
        scheme, _, given = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and bool(given) and self.token_ok(given.strip())

    def host_ok(self, request: Request) -> bool:
        """The Host the browser asked for is one of ours (DNS rebinding gets a foreign name here)."""
        return "*" in self.hosts or (request.url.hostname or "").lower() in self.hosts

    def check_action(self, request: Request, form: Mapping[str, Any]) -> str | None:
        """Why a state-changing request is refused (None: it may go on): a bearer token, or the
        session's CSRF token in the form and, where the browser says where it came from, our origin."""
        if self.bearer(request):
            return None
        session = self.session(request)
        if session is None:
            return "log in first"
        origin = request.headers.get("origin")
        if origin is not None and not same_origin(origin, request):
            return f"refused a request from another site ({origin})"
        given = form.get("csrf")
        if not isinstance(given, str) or not hmac.compare_digest(given.encode("utf-8", "replace"),
                                                                 session.csrf.encode()):
            return "the form's CSRF token is missing or stale: reload the page and try again"
        return None


def same_origin(origin: str, request: Request) -> bool:
    parts = urlsplit(origin)
    return parts.netloc == request.headers.get("host", "") and parts.scheme in ("http", "https")


def safe_next(path: str | None) -> str:
    """Where to go after login: a path of this site only (never //host or a scheme)."""
    if not path or not path.startswith("/") or path.startswith("//") or "\\" in path:
        return "/"
    return path


def login_response(gate: Gate, request: Request, target: str) -> Response:
    """A new session (the one the request had, if any, is closed) and the way to `target`."""
    gate.close(request.cookies.get(COOKIE, ""))
    key, _ = gate.open()
    response = RedirectResponse(safe_next(target), status_code=303)
    response.set_cookie(COOKIE, key, max_age=int(SESSION_S), httponly=True, samesite="strict",
                        secure=gate.secure_cookie or request.url.scheme == "https", path="/")
    return response


HEADERS = {
    # Scripts and styles from this site only; no inline script runs, nothing frames the console.
    "content-security-policy": (
        "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
        "frame-ancestors 'none'; form-action 'self'; base-uri 'none'"
    ),
    "x-content-type-options": "nosniff",
    "x-frame-options": "DENY",
    "referrer-policy": "same-origin",  # no-referrer would make the browser send `Origin: null`
    "cache-control": "no-store",
}


def guard(gate: Gate) -> Callable[[Request, Callable[[Request], Awaitable[Response]]], Awaitable[Response]]:
    """The middleware: every page but the public ones needs a session or the bearer token."""

    async def dispatch(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        path = request.url.path
        if not gate.host_ok(request) and path != "/healthz":  # a probe asks by the pod's address
            response: Response = PlainTextResponse(
                f"this console does not answer to the host name {request.url.hostname!r} "
                "(FEDMQ_CONSOLE_ALLOWED_HOSTS)", status_code=421)
        elif not path.startswith(PUBLIC) and gate.session(request) is None and not gate.bearer(request):
            if "authorization" in request.headers:  # a wrong bearer token waits, as a wrong login does
                await asyncio.sleep(FAILED_LOGIN_DELAY_S)
            wants_page = "text/html" in request.headers.get("accept", "")
            if request.method == "GET" and wants_page and not path.startswith("/fragments/"):
                query = f"?{request.url.query}" if request.url.query else ""
                response = RedirectResponse(f"/login?next={quote(path + query, safe='/')}", status_code=303)
            else:
                response = PlainTextResponse("log in to the console first (or send Authorization: Bearer)",
                                             status_code=401)
        else:
            response = await call_next(request)
        for name, value in HEADERS.items():
            response.headers.setdefault(name, value)
        return response

    return dispatch
