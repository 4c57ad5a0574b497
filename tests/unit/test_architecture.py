"""The walls between the parts, read from the code itself: every import of every module
(function-level ones too), and a fresh interpreter for what an edge process really loads."""

from __future__ import annotations

import ast
import subprocess
import sys
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("services", "shared", "kernels")
SERVICES = ("services.edge", "services.worker", "services.router")
ENGINE = "services.worker.engine"
# What the engine may use from the rest of the project: model knowledge and kernels.
ENGINE_MAY_IMPORT = ("shared.models", "kernels")
NETWORK_CLIENTS = ("aiokafka", "redis", "websockets", "starlette", "uvicorn", "prometheus_client")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@cache
def modules() -> dict[str, ast.Module]:
    found = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            found[module_name(path)] = ast.parse(path.read_text(), str(path))
    return found


def imports_of(tree: ast.Module) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def within(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def offending(source: str, forbidden: tuple[str, ...], allowed: tuple[str, ...] = ()) -> list[tuple[str, str]]:
    """(module, import) pairs where a module inside `source` imports something forbidden."""
    return sorted(
        (module, name)
        for module, tree in modules().items()
        if within(module, source)
        for name in imports_of(tree)
        if any(within(name, f) for f in forbidden) and not any(within(name, a) for a in allowed)
    )


def test_the_engine_knows_no_worker_io_and_no_network():
    # Nothing of the project outside the engine package but what it may use, and no network client.
    assert offending(ENGINE, ("services", "shared", *NETWORK_CLIENTS), allowed=(ENGINE, *ENGINE_MAY_IMPORT)) == []


def test_no_service_imports_another():
    for service in SERVICES:
        others = tuple(s for s in SERVICES if s != service)
        assert offending(service, others) == [], service


def test_the_edge_imports_neither_torch_nor_kernels():
    assert offending("services.edge", ("torch", "kernels", "triton", "services.worker")) == []


def test_shared_knows_no_service_by_import_or_by_string():
    assert offending("shared", ("services",)) == []
    named = [
        (module, node.value)
        for module, tree in modules().items()
        if within(module, "shared")
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("services.")
    ]
    assert named == []


def test_kernels_stand_alone():
    assert offending("kernels", ("services", "shared")) == []


def test_an_edge_process_never_loads_torch():
    """Every edge module, and the command that starts an edge, imported in a fresh interpreter."""
    edge_modules = [m for m in modules() if within(m, "services.edge")] + ["services.cli"]
    probe = "import sys\n" + "".join(f"import {m}\n" for m in edge_modules) + (
        "heavy = sorted(m for m in ('torch', 'triton', 'kernels', 'safetensors.torch') if m in sys.modules)\n"
        "print(','.join(heavy))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == ""
