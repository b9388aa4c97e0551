"""The layering of the code (issues 17 and 28; docs/architecture.md, "Layers"): every import arrow
points down, ``entry points -> http -> serving -> (fsm | ipc) -> spec``; inside ``serving/`` the
rooms' arrows point down too, ``(weights | batches) -> models -> engine -> (audit | auth |
metrics)``, and only the weights room imports the lifecycle (``fsm``); the trainer side stands on
``ipc`` and ``spec`` alone and the server never imports it; no module of a package imports itself
back through its siblings; and no module is over 750 lines but the table (data).

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
    assert "6 kept, 0 broken" in result.stdout, result.stdout


#: The most lines a module may have (issue 28: split by job, not by cutting in half).
MAX_MODULE_LINES = 750
#: The modules allowed over it: the transitions table (data, the one place a rule lives).
#: An explicit list, so that any other module that grows past the bound fails this test.
OVER_THE_BOUND = frozenset({"miserver/fsm/table.py"})


def test_no_module_is_over_750_lines_but_the_table():
    sizes = {
        path.relative_to(ROOT).as_posix(): len(path.read_text(encoding="utf-8").splitlines())
        for path in (ROOT / "miserver").rglob("*.py")
    }
    assert "miserver/fsm/table.py" in sizes  # the walk found the package
    over = {name: n for name, n in sorted(sizes.items()) if n > MAX_MODULE_LINES}
    assert set(over) <= OVER_THE_BOUND, {k: v for k, v in over.items() if k not in OVER_THE_BOUND}


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
        # the serving rooms: models stand below weights (a model never reaches up into the
        # runtime that drives the lifecycle over it)
        (
            "serving/models/catalogue.py",
            "import miserver.serving.weights.views",
            "The serving rooms' one-way arrows",
            "miserver.serving.models.catalogue -> miserver.serving.weights.views",
        ),
        # the rooms of one layer are independent: the Batch API does not reach into the weights
        (
            "serving/batches/store.py",
            "import miserver.serving.weights.jobs",
            "The serving rooms' one-way arrows",
            "miserver.serving.batches.store -> miserver.serving.weights.jobs",
        ),
        # the cross-cutting modules stand below every room
        (
            "serving/metrics.py",
            "import miserver.serving.models.host",
            "The serving rooms' one-way arrows",
            "miserver.serving.metrics -> miserver.serving.models.host",
        ),
        # only the weights room imports the lifecycle's core
        (
            "serving/models/host.py",
            "import miserver.fsm.table",
            "Only the weights room imports the lifecycle",
            "miserver.serving.models.host -> miserver.fsm.table",
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
