"""The Kubernetes manifests under deploy/k8s, read as the tests check them."""

from __future__ import annotations

from pathlib import Path

import yaml

K8S = Path(__file__).resolve().parents[2] / "deploy" / "k8s"
K8S_VERSIONS = ("1.34.0", "1.37.0")  # Kubernetes API versions the manifests must validate against (kubernetes-validate ships schemas)


def load_yaml_docs(path: Path) -> list:
    """The non-empty YAML documents of ``path``."""
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def k8s_resources() -> dict[str, dict]:
    """Every Kubernetes resource under deploy/k8s, keyed by file name (one resource a file)."""
    resources = {}
    for path in sorted(K8S.glob("*.yaml")):
        docs = load_yaml_docs(path)
        if all("apiVersion" in doc and "kind" in doc for doc in docs) and docs[0]["kind"] != "Kustomization":
            assert len(docs) == 1, f"{path.name}: one resource a file"
            resources[path.name] = docs[0]
    return resources


def resource_of_kind(kind: str) -> dict:
    """The one resource of ``kind`` under deploy/k8s."""
    (resource,) = [r for r in k8s_resources().values() if r["kind"] == kind]
    return resource
