"""The application's middlewares (issue 15): the body-size limit and the media-type check run
as one middleware, and the operator-token middleware is left out with ``MANAGEMENT_AUTH=none``
(where it passes every request through). Every answer (status, headers, body) and every
``weights_audit`` line is the same as with the previous five middlewares, for a matrix of
routes, bodies, types and tokens, with ``MANAGEMENT_AUTH`` none and operator."""

from __future__ import annotations

import asyncio
import json

import pytest

from miserver.http import app as app_module
from miserver.http import shutdown
from miserver.http.errors import json_errors_middleware
from miserver.http.management_auth import management_auth_middleware
from tests.unit.model_free_app import model_free_client, model_free_settings

TRN = "trainer-secret-0123456789"
OPS = "operator-secret-0123456789"
MAX_BYTES = 4096


def _previous_middlewares(settings):
    return [
        json_errors_middleware,
        shutdown.shutdown_middleware,
        management_auth_middleware,
        app_module.body_limit_middleware(settings.max_request_bytes),
        app_module.media_type_middleware,
    ]


def _requests():
    auths = {"none": {}, "trn": {"Authorization": f"Bearer {TRN}"}}
    auths["ops"] = {"Authorization": f"Bearer {OPS}"}
    types = [
        None,
        "application/json",
        "application/merge-patch+json",
        "application/octet-stream",
        "application/x-www-form-urlencoded",
        "text/plain",
        "multipart/form-data; boundary=x",
        "",
    ]
    routes = [
        ("POST", "/api/weights/quiesce"),
        ("POST", "/api/weights/commit-begin"),
        ("POST", "/api/weights/attach"),
        ("POST", "/api/weights/load"),
        ("POST", "/api/models"),
        ("PATCH", "/api/settings"),
        ("POST", "/v1/files"),
        ("POST", "/v1/chat/completions"),
        ("GET", "/api/health"),
        ("PUT", "/api/health"),
        ("POST", "/no/such/route"),
    ]
    for method, path in routes:
        for auth in auths:
            for media in types:
                for body in (None, b"{}", b'{"x": 1}', b"x" * (MAX_BYTES + 1)):
                    if body is None and media not in (None, "application/json"):
                        continue
                    yield method, path, auth, auths[auth], media, body


async def _answers(settings, tmp_path, name):
    client = await model_free_client(settings)
    out = []
    try:
        for method, path, auth, headers, media, body in _requests():
            h = dict(headers)
            if media is not None:
                h["Content-Type"] = media
            resp = await client.request(method, path, headers=h, data=body)
            text = await resp.text()
            shown = {k: v for k, v in resp.headers.items() if k not in ("Date", "Server")}
            out.append(((method, path, auth, media, body and len(body)), resp.status, shown, text))
        await asyncio.sleep(0.05)  # audit lines are written on the loop's next turn
    finally:
        await client.close()
    lines = (tmp_path / f"{name}.jsonl").read_text().splitlines()
    audit = [{k: v for k, v in json.loads(x).items() if k != "ts"} for x in lines]
    return out, audit


@pytest.mark.parametrize("auth", ["none", "operator"])
async def test_the_answers_and_audit_lines_are_those_of_the_previous_middlewares(
    auth, tmp_path, monkeypatch
) -> None:
    results = {}
    for name in ("previous", "now"):
        settings = model_free_settings(
            tmp_path / name,
            f"trn:trainer:{TRN},ops:operator:{OPS}",
            WEIGHTS_AUDIT_LOG=str(tmp_path / f"{name}.jsonl"),
            MAX_REQUEST_BYTES=str(MAX_BYTES),
            MANAGEMENT_AUTH=auth,
        )
        with monkeypatch.context() as m:
            if name == "previous":
                m.setattr(app_module, "app_middlewares", _previous_middlewares)
            results[name] = await _answers(settings, tmp_path, name)
    (prev, prev_audit), (now, now_audit) = results["previous"], results["now"]
    assert len(now) == len(prev) > 400
    for a, b in zip(prev, now, strict=True):
        assert a == b
    assert now_audit == prev_audit and len(now_audit) > 50
    statuses = {status for _, status, _, _ in now}
    assert {200, 401, 404, 405, 413, 415} <= statuses


@pytest.mark.parametrize("auth", ["none", "operator"])
def test_the_operator_middleware_is_there_only_with_management_auth_operator(
    auth, tmp_path
) -> None:
    settings = model_free_settings(tmp_path, f"ops:operator:{OPS}", MANAGEMENT_AUTH=auth)
    middlewares = app_module.create_app(settings).middlewares
    assert (management_auth_middleware in middlewares) == (auth == "operator")
    assert middlewares[0] is json_errors_middleware
    assert middlewares[1] is shutdown.shutdown_middleware
    assert len(middlewares) == (4 if auth == "operator" else 3)
    assert middlewares[-1].__name__ == "checks"  # body_checks_middleware: 413, then 415
