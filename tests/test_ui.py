"""The UIs in headless Chromium, as a user sees them after ``make run``: the Dagster asset graph shows
every asset; MLflow opens the experiment on its runs, the registry shows the champion with its schema,
and ``eval_report``'s page shows rounded headline metadata whose MLflow link opens the evaluation run.
Screenshots go to ``$RLVR_UI_SCREENSHOTS`` (a folder: ``docs/`` for the README), else a temporary one."""

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from rlvr_assets.definitions import defs
from rlvr_assets.summary import lineage_path
from support.ports import free_port
from support.tiny_models import save_tiny_llama
from support.waiting import wait_for_http

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

pytestmark = [
    pytest.mark.slow,  # runs dg dev, MLflow and a browser
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason="Debian's chromium is not installed (apt-get install chromium)"),
]


def graphql(url: str, query: str) -> dict:
    request = urllib.request.Request(f"{url}/graphql", data=json.dumps({"query": query}).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return json.load(response)


@pytest.fixture
def webserver(tmp_path):
    port = free_port()
    env = {**os.environ, "DAGSTER_HOME": str(tmp_path / "dagster"), "RLVR_HOME": str(tmp_path / "rlvr"), "VIRTUAL_ENV": sys.prefix}
    (tmp_path / "dagster").mkdir()
    server = subprocess.Popen(  # `make ui`'s command: the UI and the daemon
        [str(Path(sys.executable).parent / "dg"), "dev", "-w", "workspace.yaml", "--host", "127.0.0.1", "--port", str(port)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_for_http(f"{url}/server_info", server, "dg dev")
        graphql(url, "mutation { setNuxSeen }")  # a fresh instance shows a community pop-up until then
        yield url
    finally:
        stop(server)


def test_asset_graph_shows_every_asset(webserver, tmp_path):
    from playwright.sync_api import sync_playwright

    expected = sorted(key.to_user_string() for key in defs.resolve_asset_graph().get_all_asset_keys())
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        page = browser.new_page(viewport={"width": 1600, "height": 1000})
        page.goto(f"{webserver}{lineage_path()}", wait_until="domcontentloaded", timeout=120_000)  # the address `make run` prints
        page.wait_for_function("() => !document.body.innerText.includes('Loading')", timeout=120_000)
        for name in expected:
            page.get_by_text(name, exact=True).first.wait_for(timeout=60_000)
        text = page.inner_text("body")
        page.screenshot(path=os.environ.get("RLVR_UI_SCREENSHOT", str(tmp_path / "asset-graph.png")))
        browser.close()
    missing = [name for name in expected if name not in text]
    assert not missing, f"not shown in the asset graph: {missing}"


def start(command: list[str], env: dict, url: str, what: str) -> subprocess.Popen:
    server = subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        wait_for_http(url, server, what)
    except BaseException:
        stop(server)
        raise
    return server


def stop(server: subprocess.Popen) -> None:
    """SIGTERM to the server's process group (dg dev stops its webserver, daemon and code server); what
    has not stopped within a minute (a loaded machine) is killed."""
    os.killpg(server.pid, signal.SIGTERM)
    try:
        server.wait(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(server.pid, signal.SIGKILL)
        server.wait(timeout=30)


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory, gsm8k_dir):
    """The training path materialized on a tiny policy into a real Dagster instance, DuckDB file and
    MLflow store, then `make mlflow`'s MLflow UI and the Dagster webserver on them: (Dagster URL, MLflow URL)."""
    from dagster import DagsterInstance, materialize

    from rlvr_assets.costs import cost_report
    from support.pipeline import TRAINING, resources_for, run_config

    home = tmp_path_factory.mktemp("ui")
    mlflow_port, dagster_port = free_port(), free_port()
    env = {**os.environ, "RLVR_HOME": str(home), "DAGSTER_HOME": str(home / "dagster"), "MLFLOW_PORT": str(mlflow_port), "VIRTUAL_ENV": sys.prefix}
    (home / "dagster").mkdir()
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MLFLOW_PORT", str(mlflow_port))  # where the metadata's MLflow links point
        with DagsterInstance.local_temp(str(home / "dagster")) as instance:
            config, resources = run_config(gsm8k_dir, save_tiny_llama(home / "tiny"), steps=1), resources_for(home)
            assert materialize(TRAINING, resources=resources, run_config=config, instance=instance).success
            assert materialize([cost_report], resources=resources, instance=instance).success  # what the training cost
        links = resources["mlflow"].links()  # the addresses the metadata links to
    bin_dir = Path(sys.executable).parent
    mlflow_url, dagster_url = f"http://127.0.0.1:{mlflow_port}", f"http://127.0.0.1:{dagster_port}"
    mlflow_ui = start(  # `make mlflow`'s command
        [str(bin_dir / "mlflow"), "ui", "--backend-store-uri", f"sqlite:///{home / 'mlflow.db'}", "--artifacts-destination", str(home / "mlartifacts")]
        + ["--host", "127.0.0.1", "--port", str(mlflow_port), "--workers", "1"],
        env,
        f"{mlflow_url}/health",
        "mlflow ui",
    )
    try:
        webserver = start(  # the UI alone: no daemon starting evaluations beside the test
            [str(bin_dir / "dagster-webserver"), "-w", "workspace.yaml", "-h", "127.0.0.1", "-p", str(dagster_port)],
            env,
            f"{dagster_url}/server_info",
            "dagster-webserver",
        )
        try:
            graphql(dagster_url, "mutation { setNuxSeen }")
            yield dagster_url, mlflow_url, links
        finally:
            stop(webserver)
    finally:
        stop(mlflow_ui)


@pytest.fixture
def page():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
        yield browser.new_page(viewport={"width": 1400, "height": 900})
        browser.close()


def screenshot(page, name: str, tmp_path: Path) -> None:
    folder = Path(os.environ.get("RLVR_UI_SCREENSHOTS", str(tmp_path)))
    page.screenshot(path=str(folder / name))


def test_mlflow_opens_the_experiment_on_its_runs(pipeline, page, tmp_path):
    _, mlflow_url, links = pipeline
    page.goto(links.experiment(), wait_until="domcontentloaded", timeout=120_000)
    page.get_by_text("grpo-", exact=False).first.wait_for(timeout=60_000)  # the training run, in the runs table
    page.get_by_text("eval-", exact=False).first.wait_for(timeout=60_000)
    text = page.inner_text("body")
    assert "Model registry" in text and "No data available" not in text  # model training, not the GenAI traces overview
    screenshot(page, "mlflow-runs.png", tmp_path)
    page.goto(f"{mlflow_url}/#/experiments", wait_until="domcontentloaded")
    page.get_by_role("link", name="rlvr-ops").first.wait_for(timeout=60_000)
    assert "Default" not in page.inner_text("body")  # no empty Default experiment beside ours


def test_the_registry_shows_the_champion_with_its_schema(pipeline, page, tmp_path):
    page.goto(pipeline[2].model_version(1), wait_until="domcontentloaded", timeout=120_000)
    page.get_by_text("Inputs (2)").first.wait_for(timeout=60_000)  # the signature: question (and an optional task) in; answer, completion out
    text = page.inner_text("body")
    assert "Outputs (2)" in text and "champion" in text and "grpo-" in text  # the alias and the source run
    screenshot(page, "mlflow-registry.png", tmp_path)


def test_eval_report_shows_rounded_headline_metadata_with_a_working_mlflow_link(pipeline, page, tmp_path):
    dagster_url, mlflow_url, _ = pipeline
    page.goto(f"{dagster_url}/assets/eval_report", wait_until="domcontentloaded", timeout=120_000)
    page.get_by_text("pass@1 strict (%)").first.wait_for(timeout=120_000)
    text = page.inner_text("body")
    assert not re.search(r"\d\.\d{6,}", text), "unrounded numbers on the page"
    assert "nan" not in text.split()
    link = page.locator(f'a[href^="{mlflow_url}"]').first
    link.wait_for(timeout=30_000)
    screenshot(page, "eval-report.png", tmp_path)
    page.goto(link.get_attribute("href"), wait_until="domcontentloaded")
    page.get_by_text("eval-", exact=False).first.wait_for(timeout=60_000)  # the evaluation run's page
    assert "Model registry" in page.inner_text("body")


def test_cost_report_shows_its_tables_and_plots(pipeline, page, tmp_path):
    page.goto(f"{pipeline[0]}/assets/cost_report", wait_until="domcontentloaded", timeout=120_000)
    page.get_by_text("total CPU core-s").first.wait_for(timeout=120_000)
    page.get_by_role("cell", name="grpo_training", exact=True).first.wait_for(timeout=60_000)  # the by-asset table, inline
    text = page.inner_text("body")
    assert "CPU core-s" in text and "energy (Wh)" in text
    assert not re.search(r"\d\.\d{6,}", text), "unrounded numbers on the page"
    show_markdown("cost by asset", page)  # a plot: in the entry's dialog
    plot = page.get_by_role("dialog").locator('img[src^="data:image/png"]').first
    plot.wait_for(timeout=60_000)
    assert plot.evaluate("img => img.naturalWidth") > 0
    screenshot(page, "cost-report.png", tmp_path)


def show_markdown(label: str, page) -> None:
    """Open the Markdown of the metadata entry ``label`` (the asset page shows a link to it, in a dialog)."""
    row = page.locator("tr").filter(has=page.get_by_text(label, exact=True)).last  # the entry's own row, not a row around it
    row.get_by_text("[Show Markdown]").click()
