"""The admin API's client (`epd status|scale|drain`): every way a call fails is one AdminError that names
the URL, and a missing token is reported only once the API has been reached."""

from __future__ import annotations

import json
import re
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from controlplane.admin_client import AdminError, call
from controlplane.cli import main
from controlplane.settings import Settings

pytestmark = [pytest.mark.unit]


@pytest.fixture(autouse=True)
def _clean_env(no_epd_env, monkeypatch, tmp_path):
    monkeypatch.setenv("EPD_STATE_DIR", str(tmp_path / "state"))  # no admin token file unless a test writes one


@contextmanager
def http_server(status: int, body: bytes, content_type: str = "application/json"
                ) -> Iterator[tuple[str, list[dict]]]:
    """An HTTP server on a free loopback port answering every request with ``status`` and ``body``; yields
    its URL and the requests it has seen."""
    seen: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def _answer(self) -> None:
            seen.append({"method": self.command, "path": self.path,
                         "authorization": self.headers.get("Authorization")})
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_GET = do_PUT = do_POST = _answer

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


def _settings(token: str | None = "t" * 20) -> Settings:
    return Settings.load(None, {"api": {"admin_token": token}} if token else None)


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("url", ["notaurl", "ftp://host/x", "http://", "http://host:notaport"])
def test_a_url_that_is_not_http_is_refused_with_the_url_named(url):
    with pytest.raises(AdminError, match="is not the URL of an epd API") as err:
        call(_settings(), "GET", "/admin/pools", url=url)
    assert repr(url.rstrip("/")) in str(err.value)


def test_a_server_that_never_replies_times_out_with_the_url_named():
    with socket.socket() as listener:  # accepts connections (the kernel's backlog) and never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen(4)
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        with pytest.raises(AdminError, match="did not answer within 0.3 s") as err:
            call(_settings(), "GET", "/admin/pools", url=url, timeout=0.3)
    assert url in str(err.value)


@pytest.mark.parametrize("body", [b"<html>not json</html>", b"[1, 2]", b"\xff\xfe"])
def test_a_reply_that_is_not_a_json_object_names_the_url(body):
    with http_server(200, body, "text/html") as (url, _):
        with pytest.raises(AdminError, match="not a JSON object") as err:
            call(_settings(), "GET", "/admin/pools", url=url)
    assert url in str(err.value)


def test_an_http_error_from_something_else_than_epd_asks_whether_it_is_one():
    with http_server(404, b"<!DOCTYPE HTML><html><body>Not Found</body></html>", "text/html") as (url, _):
        with pytest.raises(AdminError) as err:
            call(_settings(), "GET", "/admin/pools", url=url)
    assert str(err.value) == (f"GET {url}/admin/pools: HTTP 404, and the reply is not epd's error shape; is {url} "
                              f"an epd API?")


def test_http_errors_carry_the_apis_message():
    body = json.dumps({"error": {"message": "replicas must be >= 0"}}).encode()
    with http_server(400, body) as (url, _):
        with pytest.raises(AdminError, match="HTTP 400: replicas must be >= 0"):
            call(_settings(), "PUT", "/admin/pools/decode", {"replicas": -1}, url=url)


def test_without_a_token_an_unreachable_api_is_reported_first():
    url = f"http://127.0.0.1:{_closed_port()}"
    with pytest.raises(AdminError, match="cannot reach the epd API") as err:
        call(_settings(None), "GET", "/admin/pools", url=url)
    assert "is `epd serve` running?" in str(err.value) and url in str(err.value)


def test_without_a_token_a_reachable_api_asks_for_one_and_gets_no_mutating_request():
    with http_server(401, b'{"detail": "missing admin token"}') as (url, seen):
        with pytest.raises(AdminError, match="no admin token: set EPD_API__ADMIN_TOKEN"):
            call(_settings(None), "PUT", "/admin/pools/decode", {"replicas": 3}, url=url)
    assert [(s["method"], s["authorization"]) for s in seen] == [("GET", None)]  # only the read-only probe


def test_a_refused_token_says_where_it_came_from(tmp_path):
    """Two local serves with different state folders have different tokens; a 401 names the token's source,
    so the operator sees which one was sent."""
    state = tmp_path / "state"
    state.mkdir()
    (state / "admin_token").write_text("file-token-0123456789\n")
    body = json.dumps({"error": {"message": "missing or wrong admin token"}}).encode()
    with http_server(401, body) as (url, _):
        with pytest.raises(AdminError, match=r"HTTP 401: missing or wrong admin token; the token sent came from "
                                             rf"the file {re.escape(str(state / 'admin_token'))}, and another"):
            call(_settings(None), "GET", "/admin/pools", url=url)
        with pytest.raises(AdminError, match=r"came from api.admin_token \(EPD_API__ADMIN_TOKEN or --config\)"):
            call(_settings(), "GET", "/admin/pools", url=url)


def test_a_token_file_is_used_and_the_json_returned(tmp_path):
    state = tmp_path / "state"
    state.mkdir()
    (state / "admin_token").write_text("file-token-0123456789\n")
    with http_server(200, b'{"pools": []}') as (url, seen):
        assert call(_settings(None), "GET", "/admin/pools", url=url) == {"pools": []}
    assert seen[-1]["authorization"] == "Bearer file-token-0123456789"


def test_epd_status_on_a_non_json_reply_is_one_line(capsys, monkeypatch):
    monkeypatch.setenv("EPD_API__ADMIN_TOKEN", "t" * 20)
    with http_server(200, b"<html>hello</html>", "text/html") as (url, _):
        assert main(["status", "--url", url]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("epd: error: ") and url in err


def test_epd_status_on_an_unexpected_json_reply_is_one_line(capsys, monkeypatch):
    monkeypatch.setenv("EPD_API__ADMIN_TOKEN", "t" * 20)
    with http_server(200, b'{"hello": 1}') as (url, _):
        assert main(["status", "--url", url]) == 2
        assert main(["scale", "decode", "2", "--url", url]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 2 and "is it an epd API" in err and "Traceback" not in err


def test_epd_status_with_a_bad_url_is_one_line(capsys):
    assert main(["status", "--url", "notaurl"]) == 2
    assert main(["drain", "w-1", "--url", "notaurl"]) == 2
    err = capsys.readouterr().err
    assert err.count("epd: error: 'notaurl' is not the URL of an epd API") == 2
