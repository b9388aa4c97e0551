"""Paths a client sends that the operating system refuses (finding N5 of the second adversarial
trial of 2026-11-30): ``POST /api/weights/adapter`` and ``POST /api/models`` answered 500 for a
path too long (ENAMETOOLONG) and ``POST /api/models`` for a symlink loop (RuntimeError from
``resolve()``). Each is a 400 INVALID_REQUEST naming ``path``, worded alike on both routes.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from miserver.serving.models import client_paths
from miserver.serving.models.client_paths import ClientPathError, check_client_path
from tests.unit.test_weights_routes import make_client


def symlink_loop(tmp_path: Path) -> Path:
    a, b = tmp_path / "loop-a", tmp_path / "loop-b"
    a.symlink_to(b)
    b.symlink_to(a)
    return a


@pytest.mark.parametrize(
    ("raw", "words"),
    [
        ("/" + "a" * 5000, "path is too long: 5001 bytes"),
        ("/x/" + "a" * 300, "path has a name of 300 bytes"),
        ("rel/x", "path must be absolute"),
        ("/x\x00y", "path must be a non-empty absolute path"),
    ],
)
def test_a_bad_path_is_refused_with_the_field_named(raw, words):
    with pytest.raises(ClientPathError, match=words):
        check_client_path(raw)


def test_a_symlink_loop_and_a_path_through_it_are_refused(tmp_path):
    loop = symlink_loop(tmp_path)
    for raw in (str(loop), str(loop / "inside")):
        with pytest.raises(ClientPathError, match="path is a symlink loop on the server"):
            check_client_path(raw)


def test_a_missing_path_passes_for_the_route_to_name(tmp_path):
    assert check_client_path(str(tmp_path / "nope")) == tmp_path / "nope"
    (tmp_path / "file").write_text("x")
    assert check_client_path(str(tmp_path / "file" / "below")) == tmp_path / "file" / "below"
    assert check_client_path(str(tmp_path)) == tmp_path


def test_the_length_limit_leaves_room_for_a_file_inside():
    limit = client_paths.MAX_PATH_BYTES
    assert limit + 1 + client_paths.NAME_MAX < client_paths.PATH_MAX
    ok = "/" + "/".join(["a" * 200] * 20)
    ok = ok[:limit]
    assert check_client_path(ok) == Path(ok)
    with pytest.raises(ClientPathError, match="too long"):
        check_client_path(ok + "b")


async def test_both_routes_answer_400_naming_path_and_change_nothing(tmp_path, tiny_model_dir):
    client = await make_client(tmp_path, tiny_model_dir)
    try:
        rows_before = (await (await client.get("/api/models")).json())["data"]
        loop = str(symlink_loop(tmp_path))
        for raw in ("/" + "a" * 5000, "/x/" + "a" * 300, loop, loop + "/adapter"):
            messages = []
            for route, body in (
                ("/api/weights/adapter", {"name": "n", "path": raw}),
                ("/api/models", {"name": "m", "path": raw}),
            ):
                resp = await client.post(route, json=body)
                answer = await resp.json()
                assert resp.status == 400, (route, answer)
                error = answer["error"]
                assert error["code"] == "INVALID_REQUEST", (route, error)
                assert error["details"] == {"field": "path"}
                assert error["message"].startswith("path ")
                assert len(error["message"]) < 400  # the path is shown cut short
                messages.append(error["message"])
            assert messages[0] == messages[1]  # one wording for one rule
        assert (await (await client.get("/api/models")).json())["data"] == rows_before
        block = (await (await client.get("/api/weights/adapter")).json())["data"]
        assert block == {"applied": False}
    finally:
        await client.close()
