"""The examples under ``examples/`` as the tests use them: loaded as modules (their parts), or
run as a user runs them (a subprocess, the short schedule on the CPU, its ``results.json``).
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

REPO = Path(__file__).resolve().parents[1]
EXAMPLES = REPO / "examples"


def load_example(name: str) -> ModuleType:
    """``examples/<name>.py`` as the module ``name``. Its folder goes first on ``sys.path``,
    as for a script run from there: the examples import ``examples/_shared.py`` by name."""
    if str(EXAMPLES) not in sys.path:
        sys.path.insert(0, str(EXAMPLES))
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def run_short_on_cpu(
    name: str, home: str, out: Path, timeout_s: float = 2300
) -> tuple[subprocess.CompletedProcess[str], str, dict[str, Any]]:
    """Run ``examples/<name>.py --schedule short --device cpu --out out`` with
    ``MISERVER_HOME=home`` and no ``WEIGHTS_*`` setting of this process's environment.

    Returns (the finished process, the tail of its output for an assertion's message, its
    ``results.json``). Raises AssertionError (with that tail) when it wrote no results."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("WEIGHTS_")}
    env.update(
        MISERVER_HOME=home,
        PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
    )
    proc = subprocess.run(
        [
            sys.executable,
            str(EXAMPLES / f"{name}.py"),
            "--schedule",
            "short",
            "--device",
            "cpu",
            "--out",
            str(out),
        ],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    log = proc.stdout[-6000:] + "\n--- stderr ---\n" + proc.stderr[-6000:]
    assert (out / "results.json").is_file(), log
    return proc, log, json.loads((out / "results.json").read_text())
