"""The Dagster UI in headless Chromium: the asset graph shows every asset of the pipeline."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from rlvr_assets.definitions import defs

ROOT = Path(__file__).resolve().parents[1]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

pytestmark = pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed (apt-get install chromium)")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def graphql(url: str, query: str) -> dict:
    request = urllib.request.Request(f"{url}/graphql", data=json.dumps({"query": query}).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


@pytest.fixture
def webserver(tmp_path):
    port = free_port()
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path / "dagster"), "RLVR_HOME": str(tmp_path / "rlvr")}
    (tmp_path / "dagster").mkdir()
    server = subprocess.Popen(
        [sys.executable, "-m", "dagster_webserver", "-w", str(ROOT / "workspace.yaml"), "-h", "127.0.0.1", "-p", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                with urllib.request.urlopen(f"{url}/server_info", timeout=5):
                    break
            except OSError:
                assert server.poll() is None, "dagster-webserver exited"
                assert time.monotonic() < deadline, "dagster-webserver did not start in 180 s"
                time.sleep(1)
        graphql(url, "mutation { setNuxSeen }")  # a fresh instance shows a community pop-up until then
        yield url
    finally:
        os.killpg(server.pid, signal.SIGTERM)
        server.wait(timeout=30)


def test_asset_graph_shows_every_asset(webserver, tmp_path):
    from playwright.sync_api import sync_playwright

    expected = sorted(key.to_user_string() for key in defs.resolve_asset_graph().get_all_asset_keys())
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        page.goto(f"{webserver}/asset-groups", wait_until="domcontentloaded", timeout=120_000)
        page.wait_for_function("() => !document.body.innerText.includes('Loading')", timeout=120_000)
        page.get_by_text("training", exact=True).first.wait_for(timeout=60_000)  # the group boxes are drawn
        page.keyboard.press("Alt+e")  # the graph's "Expand all groups"
        for name in expected:
            page.get_by_text(name, exact=True).first.wait_for(timeout=60_000)
        text = page.inner_text("body")
        page.screenshot(path=os.environ.get("RLVR_UI_SCREENSHOT", str(tmp_path / "asset-graph.png")))
        browser.close()
    missing = [name for name in expected if name not in text]
    assert not missing, f"not shown in the asset graph: {missing}"
