"""Build rlvr-ops's images with podman, all on one base image, without a registry.

    python deploy/container/build_images.py base
    python deploy/container/build_images.py policy rlvr_policy:latest --tag rlvr_policy:latest
    python deploy/container/build_images.py code-location --tag rlvr-ops:latest  # likewise dagster, proxy

``base`` is Debian 12 + Python 3.11 + uv (``base-image.sh``); ``policy`` a Bento's image through
BentoML's containerize; the others ``deploy/docker/Dockerfile*``. The build inputs, a CA bundle
(``$RLVR_BUILD_CA_BUNDLE``) and a wheel folder (``$RLVR_WHEELHOUSE``: CPU images need a ``torch+cpu``
wheel there), are bind-mounted into the builds, in no layer. Needs rootful podman.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
CONTAINERS_CONF = HERE / "containers.conf"
HOST_CA_BUNDLE = Path("/etc/ssl/certs/ca-certificates.crt")
WHEELHOUSE_MOUNT = "/run/rlvr-build/wheelhouse"
TORCH_PIN = "2.13.0"  # the Makefile's and bentos/bentofile.yaml's
# Images built from a Dockerfile of deploy/docker: the file, and whether it installs Python wheels.
DOCKERFILE_IMAGES = {"code-location": ("Dockerfile", True), "dagster": ("Dockerfile.dagster", True), "proxy": ("Dockerfile.proxy", False)}


class BuildError(RuntimeError):
    """An image could not be built; the message says which and why."""


def podman_env() -> dict[str, str]:
    """This environment, with podman reading the project's containers.conf unless one is set."""
    return {**os.environ, "CONTAINERS_CONF": os.environ.get("CONTAINERS_CONF", str(CONTAINERS_CONF))}


def podman(*args: str, capture: bool = True) -> subprocess.CompletedProcess:
    """Run podman; its output is captured, or else goes to stderr (stdout carries only the tags)."""
    if capture:
        return subprocess.run(["podman", *args], env=podman_env(), capture_output=True, text=True)
    return subprocess.run(["podman", *args], env=podman_env(), stdout=sys.stderr, text=True)


def base_image() -> str:
    """The base image's tag (built by ``base-image.sh`` when its recipe's hash is not in storage yet)."""
    result = subprocess.run(["bash", str(HERE / "base-image.sh")], env=podman_env(), stdout=subprocess.PIPE, text=True)
    if result.returncode != 0:
        raise BuildError(f"base-image.sh failed (exit {result.returncode}); its error is above")
    return result.stdout.strip().splitlines()[-1]


def wheelhouse(torch_variant: str | None) -> Path | None:
    """The folder of local wheels the build uses; for ``cpu`` it must hold torch's CPU wheel; None: no wheels."""
    if torch_variant in ("cuda", None):
        return None
    folders = [os.environ["RLVR_WHEELHOUSE"]] if os.environ.get("RLVR_WHEELHOUSE") else os.environ.get("PIP_FIND_LINKS", "").split()
    for folder in map(Path, folders):
        if any(folder.glob(f"torch-{TORCH_PIN}+cpu-*.whl")):
            return folder.resolve()
    raise BuildError(
        f"no CPU torch wheel (torch-{TORCH_PIN}+cpu-*.whl) in the wheelhouse {folders or '(none set)'}: "
        f"pip download torch=={TORCH_PIN} --index-url https://download.pytorch.org/whl/cpu -d <folder> and set "
        "RLVR_WHEELHOUSE=<folder>, or build the CUDA variant (--torch cuda)"
    )


@contextlib.contextmanager
def build_mounts(base: str, torch_variant: str | None):
    """``podman build --volume`` values of the build-time inputs: the CA bundle, uv's config, the wheelhouse."""
    extra_ca = Path(os.environ.get("RLVR_BUILD_CA_BUNDLE", HOST_CA_BUNDLE))
    if not extra_ca.is_file():
        raise BuildError(f"RLVR_BUILD_CA_BUNDLE={extra_ca} is not a file")
    wheels = wheelhouse(torch_variant)
    with tempfile.TemporaryDirectory(prefix="rlvr-build-") as tmp:
        inputs = Path(tmp)
        base_bundle = podman("run", "--rm", "--network", "none", base, "cat", str(HOST_CA_BUNDLE))
        if base_bundle.returncode != 0:
            raise BuildError(f"could not read the CA bundle of {base}: {base_bundle.stderr}")
        (inputs / "ca-certificates.crt").write_text(base_bundle.stdout + "\n" + extra_ca.read_text())
        # system-certs: uv trusts the system bundle (the one mounted below) instead of its built-in roots.
        uv_config = ["system-certs = true"] + ([f'find-links = ["{WHEELHOUSE_MOUNT}"]'] if wheels else [])
        (inputs / "uv.toml").write_text("\n".join(uv_config) + "\n")
        mounts = [f"{inputs / 'ca-certificates.crt'}:{HOST_CA_BUNDLE}:ro", f"{inputs / 'uv.toml'}:/etc/uv/uv.toml:ro"]
        if wheels:
            mounts.append(f"{wheels}:{WHEELHOUSE_MOUNT}:ro")
        yield mounts


def require_image(tag: str, what: str) -> None:
    if podman("image", "exists", tag).returncode != 0:
        raise BuildError(f"the {what} image {tag} was not built; the build's log is above")


def build_policy_image(bento_tag: str, image_tag: str, torch_variant: str = "cpu") -> str:
    """Containerize ``bento_tag`` (from ``$BENTOML_HOME``) as ``image_tag`` on the current base image.

    ``from`` replaces the Dockerfile's base with the recipe-hashed tag, so a Bento built before the
    base changed (or before the bentofile named it) still builds on the current one.
    """
    import bentoml

    base = base_image()
    with build_mounts(base, torch_variant) as mounts:
        bentoml.container.build(bento_tag, backend="podman", image_tag=(image_tag,), volume=mounts, **{"from": base})
    require_image(image_tag, f"policy ({bento_tag})")
    return image_tag


def build_dockerfile_image(dockerfile: Path, image_tag: str, torch_variant: str | None = "cpu") -> str:
    """Build ``dockerfile`` (context: the repository, filtered by its ``.dockerignore``) on the base image."""
    base = base_image()
    with build_mounts(base, torch_variant) as mounts:
        # --format docker: the OCI format has no HEALTHCHECK, and the code location's is its readiness probe.
        command = ["build", "--format", "docker", "-f", str(dockerfile), "--ignorefile", f"{dockerfile}.dockerignore"]
        command += ["--build-arg", f"BASE_IMAGE={base}"]
        command += [arg for mount in mounts for arg in ("--volume", mount)]
        result = podman(*command, "--tag", image_tag, str(ROOT), capture=False)
    if result.returncode != 0:
        raise BuildError(f"podman build of {dockerfile.relative_to(ROOT)} failed (exit {result.returncode}); its log is above")
    require_image(image_tag, dockerfile.name)
    return image_tag


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("image", choices=["base", "policy", *DOCKERFILE_IMAGES])
    parser.add_argument("bento", nargs="?", help="policy: the Bento's tag, e.g. rlvr_policy:latest")
    parser.add_argument("--tag", help="the image's tag")
    parser.add_argument("--torch", choices=["cpu", "cuda"], default="cpu", help="torch build in the image (default cpu)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stderr)  # BentoML's build log
    try:
        if args.image == "base":
            print(base_image())
        elif args.image == "policy":
            if not args.bento or not re.fullmatch(r"[\w.-]+:[\w.-]+", args.bento):
                parser.error("policy needs a Bento tag, e.g. rlvr_policy:latest")
            print(build_policy_image(args.bento, args.tag or args.bento, args.torch))
        else:
            name, installs_wheels = DOCKERFILE_IMAGES[args.image]
            torch_variant = args.torch if installs_wheels else None
            print(build_dockerfile_image(ROOT / "deploy/docker" / name, args.tag or f"rlvr-ops-{args.image}:latest", torch_variant))
    except BuildError as err:
        print(f"build_images.py: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
