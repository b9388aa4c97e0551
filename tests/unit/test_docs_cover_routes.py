"""The docs name every route the server registers: the Batch API in
docs/openai-compatibility.md, and every route in the reference (docs/reference.md)."""

from __future__ import annotations

import re

from aiohttp import web

from miserver.docs_gen import REPO_ROOT
from miserver.http import batches


def _routes(setup) -> set[tuple[str, str]]:
    app = web.Application()
    setup(app)
    return {
        (r.method, r.resource.canonical)
        for r in app.router.routes()
        if r.method != "HEAD" and r.resource is not None
    }


def test_every_batch_api_route_is_in_the_openai_compatibility_page():
    text = (REPO_ROOT / "docs/openai-compatibility.md").read_text(encoding="utf-8")
    section = text[text.index("## The Batch API") :]
    routes = _routes(lambda app: batches.setup_routes(app, home="/nonexistent"))
    assert len(routes) == 9
    for method, path in sorted(routes):
        documented = (
            re.escape(path).replace(r"\{file_id\}", r"\{id\}").replace(r"\{batch_id\}", r"\{id\}")
        )
        assert re.search(rf"`{method} {documented}`", section), f"{method} {path} undocumented"
    for reason in ("quiesced", "weights_torn", "model_not_resident"):
        assert f"`{reason}`" in section
