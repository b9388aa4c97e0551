"""docs/reference.md, the product's own reference, is generated from the code: fresh, every
registered route in it with who may call it, every error code with its statuses and reasons."""

from __future__ import annotations

from miserver import docs_gen, reference
from miserver.fsm.table import ROUTE_AUTH
from miserver.spec import codes

DOC = "docs/reference.md"


def test_the_committed_reference_is_fresh():
    committed = (docs_gen.REPO_ROOT / DOC).read_text(encoding="utf-8")
    assert committed == docs_gen.render_all()[DOC], f"{DOC} is stale: run `miserver docs`"


def test_every_route_code_and_timer_is_in_it():
    text = reference.render()
    routes = reference.routes()
    assert len(routes) >= 40
    for method, path, _doc in routes:
        assert f"| `{method} {path}` |" in text
    for trigger in ROUTE_AUTH:
        path = "/api/weights/" + (
            "load" if trigger == "weights_load" else trigger.replace("_", "-")
        )
        row = next(ln for ln in text.splitlines() if ln.startswith(f"| `POST {path}` |"))
        assert "401 WEIGHTS_UNAUTHORIZED" in row
    from miserver.http.management_auth import GUARDED

    for method, path in GUARDED:
        row = next(ln for ln in text.splitlines() if ln.startswith(f"| `{method} {path}` |"))
        assert "MANAGEMENT_AUTH=operator" in row
    clear = next(ln for ln in text.splitlines() if "`POST /api/weights/clear-stale`" in ln)
    assert "role operator" in clear
    for name, code in codes.ALL.items():
        row = next(ln for ln in text.splitlines() if ln.startswith(f"| `{name}` |"))
        assert f"| {code.status}" in row and f"`{code.wire}`" in row
        for r in code.reasons:
            assert f"`{r}`" in row
    for timer in reference.TIMERS:
        assert f"| `{timer}` |" in text
    assert "`NOT_ATTACHABLE` `not_on_gpu`" in text and "WEIGHTS_CPU_ATTACH=1" in text


def test_no_doc_points_outside_the_repository_and_the_readme_links_the_reference():
    root = docs_gen.REPO_ROOT
    for path in [root / "README.md", *sorted((root / "docs").glob("*.md"))]:
        text = path.read_text(encoding="utf-8")
        for outside in ("/work/", "shared/spec/"):
            assert outside not in text, f"{path.name} points at {outside}, outside the repository"
    readme = (root / "README.md").read_text(encoding="utf-8")
    assert "docs/reference.md" in readme and "docs/settings.md" in readme


def test_every_code_is_explained_not_named_again() -> None:
    """Issue 32, item 6: the codes whose answers word their own message were listed with their
    own name as the message; each row now says what the code means and what to do."""
    from miserver.reference import code_meaning
    from miserver.spec import codes

    text = (docs_gen.REPO_ROOT / DOC).read_text(encoding="utf-8")
    for name in codes.ALL:
        meaning = code_meaning(name)
        assert meaning != name and len(meaning.split()) >= 4, (name, meaning)
        row = next(x for x in text.splitlines() if x.startswith(f"| `{name}` |"))
        assert not row.rstrip().endswith(f"| {name} |"), row
    assert set(codes.MEANINGS) <= set(codes.ALL)
