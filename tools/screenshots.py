"""The README's pictures of a real run: ``make screenshots`` after ``make run``.

Starts ``dagster-webserver -w workspace.yaml`` (the UI without the daemon, so nothing is launched) and
``mlflow ui`` (as ``make mlflow`` does) on free loopback ports over ``$RLVR_HOME`` (default ``.rlvr``),
waits for their health URLs, and drives Debian's chromium with Playwright through the asset graph,
``eval_report``'s page, the experiment's runs and the champion's registry version. Writes
asset-graph.png, eval-report.png, mlflow-runs.png and mlflow-registry.png into ``--out`` (``docs``),
then stops both servers. Usage: ``python tools/screenshots.py [--home .rlvr] [--out docs]``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run"]
CHROMIUM_FLAGS += ["--disable-background-networking", "--disable-component-update", "--disable-sync"]
PAGE_TIMEOUT_MS = 120_000
NAMES = ("asset-graph.png", "eval-report.png", "mlflow-runs.png", "mlflow-registry.png")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for_http(url: str, server: subprocess.Popen, log: Path, timeout_s: float) -> None:
    """Return once ``url`` answers; raise, with the server's last output, if it exits or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5):
                return
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                tail = log.read_text(errors="replace")[-3000:]
                state = f"exited with {server.returncode}" if server.poll() is not None else f"did not answer in {timeout_s:.0f} s"
                raise RuntimeError(f"{server.args[0]} {state} ({url}); its last output:\n{tail}") from None
            time.sleep(1)


@contextmanager
def serving(command: list[str], env: dict, health_url: str, logs: Path, timeout_s: float = 600) -> Iterator[None]:
    """Run ``command`` in a process group of its own while the block runs, once ``health_url`` answers;
    then SIGTERM the group (SIGKILL what is left after a minute)."""
    log = logs / (Path(command[0]).name + ".log")
    with open(log, "wb") as out:
        server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_for_http(health_url, server, log, timeout_s)
        yield
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait(timeout=30)


def latest_eval_report() -> str:
    """One line on the ``eval_report`` the pictures show; SystemExit when the instance has none."""
    from dagster import AssetKey, DagsterInstance

    with DagsterInstance.get() as instance:
        event = instance.get_latest_materialization_event(AssetKey("eval_report"))
    if event is None or event.asset_materialization is None:
        raise SystemExit(f"no eval_report in the Dagster instance {os.environ['DAGSTER_HOME']}: run `make run` first")
    meta = event.asset_materialization.metadata
    return f"eval_report of run {event.run_id[:8]}: pass@1 strict {meta['pass@1 strict (%)'].value:.1f}% on {meta['problems'].value} problems"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--home", default=os.environ.get("RLVR_HOME", ".rlvr"), help="the run's data directory (RLVR_HOME)")
    parser.add_argument("--out", default=str(ROOT / "docs"), help="folder the PNG files are written to")
    args = parser.parse_args()
    home, out = Path(args.home).resolve(), Path(args.out).resolve()
    if not (home / "mlflow.db").is_file() or not (home / "dagster").is_dir():
        raise SystemExit(f"{home} holds no run (no mlflow.db or dagster/): run `make run` first")
    if not Path(CHROMIUM).exists():
        raise SystemExit(f"{CHROMIUM} is missing: apt-get install chromium")
    mlflow_port, dagster_port = free_port(), free_port()
    env = {"RLVR_HOME": str(home), "DAGSTER_HOME": str(home / "dagster"), "MLFLOW_PORT": str(mlflow_port), "VIRTUAL_ENV": sys.prefix}
    os.environ.update(env)  # before the project's modules read their settings; the MLflow links point at this port
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.path.insert(0, str(ROOT))
    from resources import Settings
    from rlvr_assets.resources import default_resources
    from rlvr_assets.summary import lineage_path

    print(latest_eval_report())
    mlflow = default_resources(Settings.from_env())["mlflow"]
    links, champion = mlflow.links(), mlflow.registry().version_for("champion")
    if champion is None:
        raise SystemExit(f"no champion in the MLflow registry of {home}: run `make run` first")
    mlflow_url, dagster_url = f"http://127.0.0.1:{mlflow_port}", f"http://127.0.0.1:{dagster_port}"
    mlflow_ui = [str(BIN / "mlflow"), "ui", "--backend-store-uri", f"sqlite:///{home / 'mlflow.db'}"]
    mlflow_ui += ["--artifacts-destination", str(home / "mlartifacts"), "--host", "127.0.0.1", "--port", str(mlflow_port), "--workers", "1"]
    webserver = [str(BIN / "dagster-webserver"), "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(dagster_port)]
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as logs:
        server_env = {**os.environ, **env}
        with serving(mlflow_ui, server_env, f"{mlflow_url}/health", Path(logs)), serving(webserver, server_env, f"{dagster_url}/server_info", Path(logs)):
            request = urllib.request.Request(
                f"{dagster_url}/graphql", data=json.dumps({"query": "mutation { setNuxSeen }"}).encode(), headers={"Content-Type": "application/json"}
            )
            urllib.request.urlopen(request, timeout=30).close()  # else a first visit shows a community pop-up
            shoot(dagster_url + lineage_path(), dagster_url, links, champion.version, out)
    print(f"wrote {', '.join(NAMES)} into {out}")


def shoot(lineage_url: str, dagster_url: str, links, champion_version: str, out: Path) -> None:
    """The four pages, each waited on until what it shows has rendered."""
    from playwright.sync_api import sync_playwright

    from rlvr_assets.definitions import defs

    assets = sorted(key.to_user_string() for key in defs.resolve_asset_graph().get_all_asset_keys())
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        page.goto(lineage_url, wait_until="domcontentloaded", timeout=PAGE_TIMEOUT_MS)
        page.get_by_text("Hide navigation").click(timeout=PAGE_TIMEOUT_MS)  # remembered by the browser: the graph gets the width
        page.reload(wait_until="domcontentloaded", timeout=PAGE_TIMEOUT_MS)  # the graph laid out for the wider view
        page.wait_for_function("() => !document.body.innerText.includes('Loading')", timeout=PAGE_TIMEOUT_MS)
        for name in assets:
            page.get_by_text(name, exact=True).first.wait_for(timeout=PAGE_TIMEOUT_MS)
        page.wait_for_load_state("networkidle", timeout=PAGE_TIMEOUT_MS)  # each asset's materialization status
        page.screenshot(path=str(out / "asset-graph.png"))

        page.set_viewport_size({"width": 1400, "height": 1400})
        page.goto(f"{dagster_url}/assets/eval_report", wait_until="domcontentloaded", timeout=PAGE_TIMEOUT_MS)
        page.get_by_text("pass@1 strict (%)").first.wait_for(timeout=PAGE_TIMEOUT_MS)
        page.screenshot(path=str(out / "eval-report.png"))

        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(links.experiment(), wait_until="domcontentloaded", timeout=PAGE_TIMEOUT_MS)
        page.get_by_text("grpo-", exact=False).first.wait_for(timeout=PAGE_TIMEOUT_MS)
        page.get_by_text("eval-", exact=False).first.wait_for(timeout=PAGE_TIMEOUT_MS)
        if page.get_by_role("button", name="Close").count():  # MLflow's assistant panel
            page.get_by_role("button", name="Close").first.click()
        page.screenshot(path=str(out / "mlflow-runs.png"))

        page.goto(links.model_version(champion_version), wait_until="domcontentloaded", timeout=PAGE_TIMEOUT_MS)
        page.get_by_text("Inputs (1)").first.wait_for(timeout=PAGE_TIMEOUT_MS)
        page.get_by_text("champion").first.wait_for(timeout=PAGE_TIMEOUT_MS)
        page.screenshot(path=str(out / "mlflow-registry.png"))
        browser.close()


if __name__ == "__main__":
    main()
