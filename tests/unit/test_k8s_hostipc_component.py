"""The hostIPC kustomize component and its guard (weights page, "Deployment: sharing the IPC
namespace (Kubernetes)").

What is checked:

- ArgoCD deploys ``k8s/base``; it never references ``k8s/components/hostipc`` (nor sets
  ``hostIPC`` by any other route) while hot-update is off. ``test_base_never_references_hostipc_component``
  is that guard; ``test_guard_fails_on_a_copy_whose_base_references_the_component`` runs it on a
  temporary copy with the reference added and shows it fails there (and passes on the unmodified
  copy, so the failure is the edit's).
- ``k8s/overlays/hostipc`` resolves to the base plus exactly ``hostIPC: true`` on the pod and
  ``runAsUser``/``runAsGroup`` 1000 on the ``miserver`` container, nothing else.
- Every manifest, as written and as resolved, validates against the Kubernetes OpenAPI schemas
  (``kubernetes-validate``, strict: unknown fields are errors).

Switching hot-update on is a deliberate commit: add ``components: [../components/hostipc]`` to
``k8s/base/kustomization.yaml`` AND set ``HOT_UPDATE_ENABLED = True`` below, in the same commit;
switching it off reverts both (docs/deployment.md). The guard checks the two agree, so an
accidental reference fails CI, and so does forgetting to remove it when the flag goes back.

kustomize itself is not on PyPI or Debian, so the overlay is resolved here by a small resolver for
the subset of kustomize this tree uses (resources, components, strategic-merge patches with a
target, images). Anything outside that subset is an error, never silently ignored, and
``test_resolver_agrees_with_kustomize`` compares it with the real ``kubectl kustomize`` wherever
kubectl is installed.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
# The guard runs on this tree; the self-test points it at a temporary copy.
K8S_ROOT = Path(os.environ.get("MISERVER_K8S_ROOT", REPO / "k8s")).resolve()

# Flip to True in the commit that adds `components: [../components/hostipc]` to
# k8s/base/kustomization.yaml (hot-update on); back to False in the commit that removes it.
HOT_UPDATE_ENABLED = False

BACKEND = ("Deployment", "miserver-backend")
BACKEND_CONTAINER = "miserver"
# Exactly what the component adds, as (path, value); list items are addressed by their name.
COMPONENT_FIELDS = {
    ("spec", "template", "spec", "hostIPC"): True,
    (
        "spec",
        "template",
        "spec",
        "containers",
        f"[name={BACKEND_CONTAINER}]",
        "securityContext",
        "runAsUser",
    ): 1000,
    (
        "spec",
        "template",
        "spec",
        "containers",
        f"[name={BACKEND_CONTAINER}]",
        "securityContext",
        "runAsGroup",
    ): 1000,
}
# The oldest Kubernetes release we support and the newest the validator carries.
KUBERNETES_VERSIONS = ("1.30", kubernetes_validate.latest_version())


# --------------------------------------------------------------------------------------------
# A resolver for the subset of kustomize used in k8s/


class UnsupportedKustomize(ValueError):
    """The tree uses a kustomize feature this resolver does not implement."""


_FIELDS = {"apiVersion", "kind", "resources", "components", "patches", "images"}
# Strategic-merge keys of the lists we merge (k8s.io/api patchMergeKey); other lists replace.
_MERGE_KEYS = {
    "containers": "name",
    "initContainers": "name",
    "volumes": "name",
    "env": "name",
    "volumeMounts": "mountPath",
    "imagePullSecrets": "name",
}
_POD_TEMPLATE_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}


def load_kustomization(directory: Path) -> dict[str, Any]:
    """Read ``directory/kustomization.yaml``; raise for fields outside the supported subset."""
    for name in ("kustomization.yaml", "kustomization.yml", "Kustomization"):
        path = directory / name
        if path.is_file():
            data = yaml.safe_load(path.read_text()) or {}
            unknown = set(data) - _FIELDS
            if unknown:
                raise UnsupportedKustomize(f"{path}: fields {sorted(unknown)} are not supported")
            return data
    raise FileNotFoundError(f"no kustomization in {directory}")


def _key(obj: dict[str, Any]) -> tuple[str, str]:
    return obj["kind"], obj["metadata"]["name"]


def strategic_merge(base: Any, patch: Any) -> Any:
    """Apply a strategic-merge ``patch`` to ``base`` (returns a new value)."""
    if not isinstance(patch, dict) or not isinstance(base, dict):
        return copy.deepcopy(patch)
    out = copy.deepcopy(base)
    for k, v in patch.items():
        if k.startswith("$"):
            raise UnsupportedKustomize(f"patch directive {k} is not supported")
        if v is None:
            out.pop(k, None)
        elif isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = strategic_merge(out[k], v)
        elif isinstance(v, list) and k in _MERGE_KEYS and isinstance(out.get(k), list):
            merge_key = _MERGE_KEYS[k]
            items = out[k]
            for item in v:
                match = next(
                    (i for i, b in enumerate(items) if b.get(merge_key) == item.get(merge_key)),
                    None,
                )
                if match is None:
                    items.append(copy.deepcopy(item))
                else:
                    items[match] = strategic_merge(items[match], item)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _matches(obj: dict[str, Any], target: dict[str, Any]) -> bool:
    group, _, version = obj["apiVersion"].rpartition("/")
    want = {
        "group": group,
        "version": version,
        "kind": obj["kind"],
        "name": obj["metadata"]["name"],
    }
    unknown = set(target) - set(want)
    if unknown:
        raise UnsupportedKustomize(f"patch target fields {sorted(unknown)} are not supported")
    return all(want[k] == v for k, v in target.items())


def _apply_patches(directory: Path, spec: dict[str, Any], objs: list[dict[str, Any]]) -> None:
    for entry in spec.get("patches") or []:
        if set(entry) - {"path", "patch", "target"}:
            raise UnsupportedKustomize(f"{directory}: patch fields {sorted(entry)}")
        text = (directory / entry["path"]).read_text() if "path" in entry else entry["patch"]
        patch = yaml.safe_load(text)
        if not isinstance(patch, dict):
            raise UnsupportedKustomize(f"{directory}: only strategic-merge patches are supported")
        target = entry.get("target") or {"kind": patch["kind"], "name": patch["metadata"]["name"]}
        hits = [i for i, o in enumerate(objs) if _matches(o, target)]
        if not hits and "target" not in entry:  # as kustomize: only an untargeted patch must hit
            raise ValueError(f"{directory}: patch {_key(patch)} matches nothing")
        for i in hits:
            body = {k: v for k, v in patch.items() if k not in ("apiVersion", "kind", "metadata")}
            objs[i] = strategic_merge(objs[i], body)


def _apply_images(spec: dict[str, Any], objs: list[dict[str, Any]]) -> None:
    for image in spec.get("images") or []:
        if set(image) - {"name", "newName", "newTag", "digest"}:
            raise UnsupportedKustomize(f"image fields {sorted(image)}")
        for obj in objs:
            if obj["kind"] not in _POD_TEMPLATE_KINDS:
                continue
            pod = obj["spec"]["template"]["spec"]
            for c in pod.get("containers", []) + pod.get("initContainers", []):
                ref = c["image"]
                name = ref.split("@", 1)[0]
                if ":" in name.rsplit("/", 1)[-1]:
                    name = name.rsplit(":", 1)[0]
                if name != image["name"]:
                    continue
                new = image.get("newName", name)
                if "digest" in image:
                    c["image"] = f"{new}@{image['digest']}"
                elif "newTag" in image:
                    c["image"] = f"{new}:{image['newTag']}"
                else:
                    c["image"] = new + ref[len(name) :]


def build(
    directory: Path,
    *,
    skip: frozenset[Path] = frozenset(),
    _kind: str = "Kustomization",
    _objs: list[dict[str, Any]] | None = None,
) -> list[dict[str, Any]]:
    """Resolve a kustomization directory to its list of resources (``kubectl kustomize``).

    ``skip`` lists component directories to leave out (used to rebuild the base as it is with
    hot-update off). Raises :class:`UnsupportedKustomize` outside the supported subset.
    """
    directory = directory.resolve()
    spec = load_kustomization(directory)
    if spec.get("kind", "Kustomization") != _kind:
        raise ValueError(f"{directory}: expected kind {_kind}, found {spec.get('kind')}")
    objs = [] if _objs is None else _objs
    for entry in spec.get("resources") or []:
        path = (directory / entry).resolve()
        if path.is_dir():
            objs.extend(build(path, skip=skip))
        else:
            objs.extend(d for d in yaml.safe_load_all(path.read_text()) if d)
    for entry in spec.get("components") or []:
        path = (directory / entry).resolve()
        if path not in skip:
            objs = build(path, skip=skip, _kind="Component", _objs=objs)
    _apply_patches(directory, spec, objs)
    _apply_images(spec, objs)
    keys = [_key(o) for o in objs]
    dup = {k for k in keys if keys.count(k) > 1}
    if dup:
        raise ValueError(f"{directory}: duplicate resources {sorted(dup)}")
    return objs


def references(directory: Path, target: Path, _chain: tuple[str, ...] = ()) -> list[str]:
    """Every path in ``directory``'s kustomization tree that reaches ``target`` (or inside it)."""
    directory, target = directory.resolve(), target.resolve()
    spec = load_kustomization(directory)
    found: list[str] = []
    for field in ("resources", "components"):
        for entry in spec.get(field) or []:
            path = (directory / entry).resolve()
            chain = (*_chain, f"{directory.name}/kustomization.yaml {field}: {entry}")
            if path == target or target in path.parents:
                found.append(" -> ".join(chain))
            elif path.is_dir():
                found.extend(references(path, target, chain))
    return found


def flatten(value: Any, prefix: tuple[str, ...] = ()) -> dict[tuple[str, ...], Any]:
    """Leaf paths of a manifest; list items are addressed ``[name=...]`` when they carry a name."""
    if isinstance(value, dict) and value:
        out: dict[tuple[str, ...], Any] = {}
        for k, v in value.items():
            out.update(flatten(v, (*prefix, str(k))))
        return out
    if isinstance(value, list) and value:
        out = {}
        for i, v in enumerate(value):
            label = f"[name={v['name']}]" if isinstance(v, dict) and "name" in v else f"[{i}]"
            out.update(flatten(v, (*prefix, label)))
        return out
    return {prefix: value}


def manifest_diff(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> dict[Any, Any]:
    """{(kind, name): {path: (before, after)}} for every leaf that differs; missing is ``<absent>``."""
    a = {_key(o): flatten(o) for o in before}
    b = {_key(o): flatten(o) for o in after}
    diff: dict[Any, Any] = {}
    for key in a.keys() | b.keys():
        fa, fb = a.get(key, {}), b.get(key, {})
        changed = {
            p: (fa.get(p, "<absent>"), fb.get(p, "<absent>"))
            for p in fa.keys() | fb.keys()
            if fa.get(p, "<absent>") != fb.get(p, "<absent>")
        }
        if changed:
            diff[key] = changed
    return diff


def guard_problems(k8s_root: Path, enabled: bool) -> list[str]:
    """Why ``k8s_root/base`` disagrees with the hot-update switch; empty when it agrees."""
    base, component = k8s_root / "base", k8s_root / "components" / "hostipc"
    refs = references(base, component)
    resolved = build(base)
    host_ipc = [
        f"{o['kind']}/{o['metadata']['name']}"
        for o in resolved
        if o["kind"] in _POD_TEMPLATE_KINDS and o["spec"]["template"]["spec"].get("hostIPC")
    ]
    if not enabled:
        problems = [f"k8s/base references the hostipc component: {r}" for r in refs]
        problems += [f"k8s/base resolves with hostIPC: true on {h}" for h in host_ipc]
        return problems
    problems = []
    if not refs:
        problems.append("HOT_UPDATE_ENABLED is True but k8s/base does not reference the component")
    if manifest_diff(resolved, build(k8s_root / "overlays" / "hostipc")):
        problems.append("with hot-update on, k8s/base must resolve to the hostipc overlay")
    return problems


# --------------------------------------------------------------------------------------------
# The guard and the overlay


def test_base_never_references_hostipc_component():
    problems = guard_problems(K8S_ROOT, HOT_UPDATE_ENABLED)
    assert not problems, "\n".join(problems) + "\nSee docs/deployment.md (enabling hot-update)."


def _copy_tree(tmp_path: Path) -> Path:
    root = tmp_path / "k8s"
    shutil.copytree(REPO / "k8s", root)
    return root


def _run_guard_on(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MISERVER_K8S_ROOT": str(root)}
    node = f"{Path(__file__).relative_to(REPO)}::test_base_never_references_hostipc_component"
    return subprocess.run(
        # Without the hypothesis plugin: it costs two seconds to import and is not used here.
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "no:hypothesispytest",
            "--no-header",
            node,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.full  # tens of seconds: left out of make quick
def test_guard_fails_on_a_copy_whose_base_references_the_component(tmp_path):
    root = _copy_tree(tmp_path)
    untouched = _run_guard_on(root)
    assert untouched.returncode == 0, untouched.stdout + untouched.stderr

    kustomization = root / "base" / "kustomization.yaml"
    kustomization.write_text(kustomization.read_text() + "components:\n  - ../components/hostipc\n")
    edited = _run_guard_on(root)
    assert edited.returncode == 1, edited.stdout + edited.stderr
    assert "k8s/base references the hostipc component" in edited.stdout
    assert "components: ../components/hostipc" in edited.stdout


def test_guard_finds_a_reference_through_a_nested_kustomization(tmp_path):
    root = _copy_tree(tmp_path)
    nested = root / "base" / "extras"
    nested.mkdir()
    (nested / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        "components:\n  - ../../components/hostipc\n"
    )
    assert references(root / "base", root / "components" / "hostipc") == []
    kustomization = root / "base" / "kustomization.yaml"
    kustomization.write_text(
        kustomization.read_text().replace("  - service.yaml\n", "  - service.yaml\n  - extras\n")
    )
    refs = references(root / "base", root / "components" / "hostipc")
    assert len(refs) == 1 and "extras" in refs[0]
    assert guard_problems(root, enabled=False)


def test_guard_catches_hostipc_written_into_the_base_directly(tmp_path):
    root = _copy_tree(tmp_path)
    deployment = root / "base" / "deployment.yaml"
    text = deployment.read_text()
    assert "      containers:\n" in text
    deployment.write_text(
        text.replace("      containers:\n", "      hostIPC: true\n      containers:\n", 1)
    )
    problems = guard_problems(root, enabled=False)
    assert problems == ["k8s/base resolves with hostIPC: true on Deployment/miserver-backend"]


def test_switch_on_must_be_matched_by_the_base(tmp_path):
    """HOT_UPDATE_ENABLED = True without the components line (or the reverse) is refused."""
    root = _copy_tree(tmp_path)
    assert guard_problems(root, enabled=True) == [
        "HOT_UPDATE_ENABLED is True but k8s/base does not reference the component",
        "with hot-update on, k8s/base must resolve to the hostipc overlay",
    ]
    kustomization = root / "base" / "kustomization.yaml"
    kustomization.write_text(kustomization.read_text() + "components:\n  - ../components/hostipc\n")
    assert guard_problems(root, enabled=True) == []
    assert guard_problems(root, enabled=False)


def test_overlay_is_base_plus_exactly_the_component_fields():
    component = (K8S_ROOT / "components" / "hostipc").resolve()
    base = build(K8S_ROOT / "base", skip=frozenset({component}))  # the base with hot-update off
    overlay = build(K8S_ROOT / "overlays" / "hostipc")
    diff = manifest_diff(base, overlay)
    assert diff == {
        BACKEND: {path: ("<absent>", value) for path, value in COMPONENT_FIELDS.items()}
    }


def test_component_is_a_kustomize_component_applied_by_the_overlay():
    component = load_kustomization(K8S_ROOT / "components" / "hostipc")
    assert (component["apiVersion"], component["kind"]) == (
        "kustomize.config.k8s.io/v1alpha1",
        "Component",
    )
    overlay = load_kustomization(K8S_ROOT / "overlays" / "hostipc")
    assert overlay["resources"] == ["../../base"]
    assert overlay["components"] == ["../../components/hostipc"]


def test_base_backend_runs_the_pinned_uid_only_through_the_image():
    """The base states no runAsUser (the component does); the pod still refuses root."""
    backend = next(
        o
        for o in build(
            K8S_ROOT / "base", skip=frozenset({(K8S_ROOT / "components" / "hostipc").resolve()})
        )
        if _key(o) == BACKEND
    )
    pod = backend["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    container = next(c for c in pod["containers"] if c["name"] == BACKEND_CONTAINER)
    assert "runAsUser" not in container.get("securityContext", {})
    assert container["image"] == "miserver:0.1.0"


# --------------------------------------------------------------------------------------------
# Schemas


def _manifest_files() -> list[Path]:
    return sorted(p for p in (K8S_ROOT / "base").glob("*.yaml") if p.name != "kustomization.yaml")


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
@pytest.mark.parametrize("source", ["files", "base", "overlay"])
def test_every_manifest_validates_against_kubernetes_schemas(source, version):
    if source == "files":
        docs = [d for p in _manifest_files() for d in yaml.safe_load_all(p.read_text()) if d]
    else:
        docs = build(K8S_ROOT / ("base" if source == "base" else "overlays/hostipc"))
    assert {d["kind"] for d in docs} == {
        "ConfigMap",
        "PersistentVolumeClaim",
        "Deployment",
        "Service",
    }
    for doc in docs:
        kubernetes_validate.validate(doc, version, strict=True)


def test_schema_validation_rejects_a_misspelt_field():
    overlay = build(K8S_ROOT / "overlays" / "hostipc")
    backend = copy.deepcopy(next(o for o in overlay if _key(o) == BACKEND))
    pod = backend["spec"]["template"]["spec"]
    pod["hostIpc"] = pod.pop("hostIPC")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(backend, KUBERNETES_VERSIONS[0], strict=True)


# --------------------------------------------------------------------------------------------
# The resolver itself


def test_strategic_merge_merges_containers_by_name_and_replaces_other_lists():
    base = {"containers": [{"name": "a", "image": "x", "args": ["1"]}, {"name": "b", "image": "y"}]}
    patch = {"containers": [{"name": "b", "securityContext": {"runAsUser": 1000}}, {"name": "c"}]}
    merged = strategic_merge(base, patch)
    assert merged["containers"] == [
        {"name": "a", "image": "x", "args": ["1"]},
        {"name": "b", "image": "y", "securityContext": {"runAsUser": 1000}},
        {"name": "c"},
    ]
    assert strategic_merge({"args": ["1", "2"]}, {"args": ["3"]}) == {"args": ["3"]}
    assert strategic_merge({"a": 1, "b": 2}, {"a": None}) == {"b": 2}
    with pytest.raises(UnsupportedKustomize):
        strategic_merge({"a": 1}, {"$patch": "delete"})


def test_resolver_refuses_fields_it_does_not_implement(tmp_path):
    root = _copy_tree(tmp_path)
    kustomization = root / "base" / "kustomization.yaml"
    kustomization.write_text(kustomization.read_text() + "namePrefix: x-\n")
    with pytest.raises(UnsupportedKustomize, match="namePrefix"):
        build(root / "base")


def _kustomize_command() -> list[str] | None:
    if shutil.which("kustomize"):
        return ["kustomize", "build"]
    if shutil.which("kubectl"):
        return ["kubectl", "kustomize"]
    return None


@pytest.mark.skipif(
    _kustomize_command() is None, reason="neither kustomize nor kubectl is installed"
)
@pytest.mark.parametrize("target", ["base", "overlays/hostipc"])
def test_resolver_agrees_with_kustomize(target):
    out = subprocess.run(
        [*_kustomize_command(), str(K8S_ROOT / target)],  # type: ignore[misc]
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    real = [d for d in yaml.safe_load_all(out) if d]
    assert manifest_diff(real, build(K8S_ROOT / target)) == {}


def test_the_enabling_snippet_in_the_docs_turns_the_base_into_the_overlay(tmp_path):
    """docs/deployment.md's `components:` block, added to a copy of the base, gives the overlay."""
    docs = (REPO / "docs" / "deployment.md").read_text()
    blocks = [b for b in docs.split("```yaml\n")[1:] if "components:" in b.split("```")[0]]
    assert len(blocks) == 1, "docs/deployment.md should show the enabling block once"
    snippet = textwrap.dedent(blocks[0].split("```")[0].rstrip(" "))
    assert "HOT_UPDATE_ENABLED = True" in docs and "HOT_UPDATE_ENABLED = False" in docs
    root = _copy_tree(tmp_path)
    kustomization = root / "base" / "kustomization.yaml"
    kustomization.write_text(kustomization.read_text() + snippet + "\n")
    assert references(root / "base", root / "components" / "hostipc")
    assert manifest_diff(build(root / "base"), build(root / "overlays" / "hostipc")) == {}
    assert guard_problems(root, enabled=True) == []
