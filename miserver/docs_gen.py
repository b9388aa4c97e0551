"""``miserver docs``: regenerate the generated documents from their sources.

Each generator maps a path (relative to the repository root) to a function returning the file's
text: the state machine page, the settings reference and the weights API's JSON schema.
Tests compare the committed files with :func:`render_all` so a stale file fails CI.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]


#: The last mutation sweep of the table (``python -m tests.model.mutation`` writes it).
MUTATION_RESULT = "docs/state-machine-mutants.json"


def _state_machine() -> str:
    import json

    from miserver.fsm.diagram import render

    path = REPO_ROOT / MUTATION_RESULT
    result = json.loads(path.read_text(encoding="utf-8")) if path.exists() else None
    return render(mutants=result)


def _weights_schema() -> str:
    from miserver.spec.schema import render

    return render()


def _settings_reference() -> str:
    from miserver.spec.settings_reference import render

    return render()


def _reference() -> str:
    from miserver.reference import render

    return render()


#: path relative to the repository root -> generator
GENERATORS: dict[str, Callable[[], str]] = {
    "docs/state-machine.md": _state_machine,
    "docs/settings.md": _settings_reference,
    "docs/reference.md": _reference,
    "docs/schemas/millm-weights-api-v1.json": _weights_schema,
}


def render_all() -> dict[str, str]:
    """Every generated file's expected text, by path relative to the repository root."""
    return {path: gen() for path, gen in GENERATORS.items()}


def stale(root: Path = REPO_ROOT) -> list[str]:
    """The generated files under ``root`` that differ from what the sources generate."""
    out = []
    for path, text in render_all().items():
        target = root / path
        if not target.exists() or target.read_text(encoding="utf-8") != text:
            out.append(path)
    return out


def main(root: Path = REPO_ROOT) -> int:
    """Write every generated file under ``root``; prints what changed. Returns 0."""
    for path, text in render_all().items():
        target = root / path
        target.parent.mkdir(parents=True, exist_ok=True)
        old = target.read_text(encoding="utf-8") if target.exists() else None
        if old != text:
            target.write_text(text, encoding="utf-8")
            print(f"miserver docs: wrote {path}")
        else:
            print(f"miserver docs: {path} is up to date")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
