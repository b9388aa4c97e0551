"""The layering of the code (issue 17; docs/architecture.md, "Layers"): every import arrow points
down, ``entry points -> http -> serving -> (fsm | ipc) -> spec``, the trainer side stands on
``ipc`` and ``spec`` alone and the server never imports it, and no module of a package imports
itself back through its siblings.

The contracts are import-linter's (``[tool.importlinter]`` in pyproject.toml); this test runs
``lint-imports`` over the package. The second test shows the contracts bite: it copies the
package, plants one forbidden import (or one circle) in the copy, and requires lint-imports to
name the broken contract and the planted import.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(cwd: Path) -> subprocess.CompletedProcess[str]:
    """``lint-imports`` over the ``miserver`` package found first on the path from ``cwd``, with
    the contracts of ``cwd/pyproject.toml``; no cache (a stale graph must not pass)."""
    assert LINT_IMPORTS.exists(), f"{LINT_IMPORTS} is missing: install the dev extras"
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", str(cwd / "pyproject.toml")],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_the_layers_hold_and_there_is_no_import_circle():
    result = lint_imports(ROOT)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "4 kept, 0 broken" in result.stdout, result.stdout


@pytest.mark.parametrize(
    ("module", "planted", "contract", "reported"),
    [
        # the contract's error must not depend on the web layer that renders it
        (
            "spec/errors.py",
            "import miserver.http.errors",
            "One-way layers",
            "miserver.spec.errors -> miserver.http.errors",
        ),
        # the domain layer never imports the web layer (the first finding)
        (
            "serving/weights/runtime.py",
            "from miserver.http import keys",
            "One-way layers",
            "miserver.serving.weights.runtime -> miserver.http.keys",
        ),
        # the lifecycle's core and the IPC layer are independent of each other
        (
            "fsm/machine.py",
            "import miserver.ipc.export",
            "One-way layers",
            "miserver.fsm.machine -> miserver.ipc.export",
        ),
        # the trainer side stands on ipc and spec alone
        (
            "trainer/weights.py",
            "import miserver.serving.models.host",
            "The trainer side stands on ipc and spec only",
            "miserver.trainer.weights -> miserver.serving.models.host",
        ),
        # the server never imports the trainer side
        (
            "serving/models/host.py",
            "import miserver.trainer.weights",
            "The server never imports the trainer side",
            "miserver.serving.models.host -> miserver.trainer.weights",
        ),
        # a circle: adapters imports base_tensors, so base_tensors may not import adapters
        (
            "serving/models/base_tensors.py",
            "import miserver.serving.models.adapters",
            "No import circle",
            ".base_tensors -> .adapters (1 import)",
        ),
    ],
)
def test_a_planted_forbidden_import_or_circle_breaks_a_contract(
    tmp_path, module, planted, contract, reported
):
    copy = tmp_path / "miserver"
    shutil.copytree(ROOT / "miserver", copy, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    clean = lint_imports(tmp_path)
    assert clean.returncode == 0, clean.stdout + clean.stderr  # the copy itself is clean
    target = copy / module
    target.write_text(target.read_text() + f"\n{planted}  # planted by the test\n")
    result = lint_imports(tmp_path)
    out = result.stdout + result.stderr
    assert result.returncode != 0, out
    broken = [line for line in out.splitlines() if line.endswith(" BROKEN")]
    assert any(line.startswith(contract) for line in broken), out
    assert reported in out, out
