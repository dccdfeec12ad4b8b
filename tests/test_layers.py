"""The layers import one way only (docs/architecture.md): every import in every file, function-level
ones included, is checked against what its layer may not import."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LIBRARIES = ("dagster", "dagster_duckdb", "dagster_pipes", "dagster_k8s", "dagster_webserver", "duckdb", "mlflow", "bentoml")
FORBIDDEN = {
    "rlvr": LIBRARIES + ("resources", "rlvr_assets", "sensors", "bentos"),  # the core: plain Python
    "bentos": ("dagster", "dagster_duckdb", "duckdb", "mlflow", "resources", "rlvr_assets", "sensors"),  # core only
    "resources": ("rlvr_assets", "sensors"),
}


def imports(path: Path) -> set[str]:
    """Top-level package names of every import in ``path`` (relative imports excluded: same package)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_no_layer_imports_what_sits_above_it(layer):
    files = sorted((ROOT / layer).rglob("*.py"))
    assert files, f"no Python files under {layer}/"
    offences = {str(path.relative_to(ROOT)): sorted(imports(path) & set(FORBIDDEN[layer])) for path in files if imports(path) & set(FORBIDDEN[layer])}
    assert not offences, f"{layer}/ may not import {FORBIDDEN[layer]}: {offences}"


def test_the_check_sees_function_level_imports(tmp_path):
    source = tmp_path / "m.py"
    source.write_text("def f():\n    import mlflow.tracking\n    from dagster import asset\n    from . import sibling\n")
    assert imports(source) == {"mlflow", "dagster"}


def test_the_launched_worker_is_a_resources_module_the_check_covers():
    """torchrun runs the GRPO worker by module path (``-m``): that module is a file under resources/, one
    of those the check above reads, and imports neither assets nor sensors."""
    import importlib.util

    from resources.k8s_launcher import K8sTrainingLauncher
    from resources.launcher import WORKER_MODULE, TrainingLauncher

    path = Path(importlib.util.find_spec(WORKER_MODULE).origin).resolve()
    assert path in set((ROOT / "resources").rglob("*.py")), f"{WORKER_MODULE} ({path}) is not a module under resources/"
    assert not imports(path) & set(FORBIDDEN["resources"])
    assert TrainingLauncher(python="py").command(1)[-2:] == ["-m", WORKER_MODULE]
    pod = K8sTrainingLauncher(image="i").manifests("run", 1, "i", "ns", Path("/data/rlvr/s")).pod_spec
    assert pod["containers"][0]["command"][-2:] == ["-m", WORKER_MODULE]
