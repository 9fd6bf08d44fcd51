"""A real JupyterLab and a real browser for the notebook tests in this folder.

``lab``: one JupyterLab server per test process (pytest-xdist runs one per worker), on a free port
of 127.0.0.1, serving a temporary copy of the repository's ``solutions/`` folder, so that nothing a
notebook writes lands in the repository. It is started with the command line ``llmu lab`` runs
(:func:`llmu.cli.lab_command`), plus the options a test needs (port, token, no browser). Its
configuration, runtime, settings and workspace folders are temporary too, and three user settings
make the page predictable:

* ``windowingMode: none``: JupyterLab 4 otherwise renders only the cells near the viewport, and a
  widget that was never attached looks the same as one that failed;
* no news toast (it would cover the bottom of every screenshot);
* no autosave (a test saves a notebook once, when its run is over);

and two make a saved notebook hold what nbclient would have stored, for the checks on its run: each
cell's timing (``recordTiming``) and the widgets' state (``saveState``). Each notebook of the copy ends
with the memory probe cell (``llmu.course.add_memory_probe``).

``checkout_lab``: the same, started in a temporary copy of a checkout (``llmu/`` and one released
notebook), as ``llmu lab`` starts it: for the notebooks' links to llmu's code.

``browser``: Debian's Chromium (``apt-get install chromium``; ``make chromium`` does it), driven
headless by Playwright. Playwright's own browser download is never used. Without Chromium or
Playwright the tests skip with the reason, except in CI (``CI=true``), where they fail.

``lab_page``: one browser tab with JupyterLab loaded, shared by the tests of a process; it holds
``window.llmuProbe`` (lab_probe.js), the helpers the tests call inside the page.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import socket
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import pytest

from llmu import course

# Seconds for JupyterLab to answer after it starts (it imports nbgrader's server extensions).
SERVER_START_S = 90
PROBE_JS = Path(__file__).with_name("lab_probe.js")
USER_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none", "recordTiming": True},
    "@jupyter-widgets/jupyterlab-manager/plugin.jupyterlab-settings": {"saveState": True},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false"},
    "@jupyterlab/docmanager-extension/plugin.jupyterlab-settings": {"autosave": False},
}
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run", "--mute-audio"]


def unavailable(reason: str):
    """A missing browser fails the test in CI and skips it elsewhere, with the same reason."""
    if os.environ.get("CI", "").lower() in {"1", "true", "yes"}:
        pytest.fail(f"{reason} (CI=true: the browser tests must run here)", pytrace=False)
    pytest.skip(reason)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LabServer:
    root: Path       # the folder JupyterLab serves: a copy of solutions/
    port: int
    token: str
    process: subprocess.Popen
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:]


def _wait_until_up(server: LabServer) -> bool:
    request = urllib.request.Request(f"{server.url}/api/status", headers={"Authorization": f"token {server.token}"})
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                if response.status == 200:
                    return True
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(0.5)
    return False


def _start_lab(home: Path, root: Path) -> LabServer:
    """JupyterLab as ``llmu lab`` starts it for a course root ``root`` (it serves ``root``)."""
    from llmu.cli import lab_command

    env = dict(os.environ)
    for name, folder in [("JUPYTER_CONFIG_DIR", "config"), ("JUPYTER_RUNTIME_DIR", "runtime"),
                         ("IPYTHONDIR", "ipython"), ("JUPYTERLAB_SETTINGS_DIR", "settings"),
                         ("JUPYTERLAB_WORKSPACES_DIR", "workspaces")]:
        env[name] = str(home / folder)
        (home / folder).mkdir(parents=True, exist_ok=True)
    env.setdefault("OMP_NUM_THREADS", "1")  # the kernels share the CPUs with the other test process
    for relative, values in USER_SETTINGS.items():
        path = home / "settings" / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(values))

    token = secrets.token_hex(16)
    log = home / "lab.log"
    # A free port can be taken between the check and the server's bind: try a few.
    for _attempt in range(3):
        port = _free_port()
        command = lab_command(["--no-browser", "--ip=127.0.0.1", f"--port={port}", "--ServerApp.port_retries=0",
                               f"--IdentityProvider.token={token}", "--LabApp.expose_app_in_browser=True",
                               "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate"], root=root)
        with open(log, "ab") as out:
            process = subprocess.Popen(command, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT)
        server = LabServer(root=root, port=port, token=token, process=process, log=log)
        if _wait_until_up(server):
            return server
        _stop(process)
    raise RuntimeError(f"JupyterLab did not start; its log ends with:\n{server.log_tail()}")


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM: JupyterLab shuts its kernels down itself before it exits."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@pytest.fixture(scope="session")
def lab(tmp_path_factory) -> LabServer:
    home = tmp_path_factory.mktemp("jupyterlab")
    root = home / "notebooks"
    shutil.copytree(course.solutions_dir(), root, ignore=shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__"))
    for notebook in sorted(root.glob("*/*.ipynb")):
        course.add_memory_probe(notebook)
    server = _start_lab(home, root)
    yield server
    _stop(server.process)


#: The released notebook the checkout's lab (``checkout_lab``) holds.
CHECKOUT_NOTEBOOK = "06_kv_cache"


@pytest.fixture(scope="session")
def checkout_lab(tmp_path_factory) -> LabServer:
    """JupyterLab as ``llmu lab`` starts it in a checkout: its root is the checkout, it opens at
    ``course/``. The checkout is a temporary copy holding ``llmu/`` and one released notebook,
    ``course/06_kv_cache/`` (opening a notebook starts a kernel, which must not write into the
    repository)."""
    home = tmp_path_factory.mktemp("jupyterlab-checkout")
    root = home / "checkout"
    ignore = shutil.ignore_patterns(".ipynb_checkpoints", "__pycache__", "*.pyc")
    shutil.copytree(course.repo_root() / "llmu", root / "llmu", ignore=ignore)
    shutil.copytree(course.course_dir() / CHECKOUT_NOTEBOOK, course.course_dir(root) / CHECKOUT_NOTEBOOK, ignore=ignore)
    server = _start_lab(home, root)
    yield server
    _stop(server.process)


@pytest.fixture(scope="session")
def browser(chromium):
    executable = chromium
    if executable is None:
        unavailable("Chromium is not installed: run `make chromium` (apt-get install chromium) or set LLMU_CHROMIUM")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        unavailable("Playwright is not installed: pip install -e '.[dev]'")
    playwright = sync_playwright().start()
    try:
        chromium = playwright.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_ARGS)
    except Exception as exc:
        playwright.stop()
        raise RuntimeError(f"{executable} did not start under Playwright: {exc}") from exc
    yield chromium
    chromium.close()
    playwright.stop()


@pytest.fixture(scope="session")
def lab_page(browser, lab):  # the browser first: without one, no server is started for nothing
    """A tab with JupyterLab loaded, the side panels closed, and window.llmuProbe defined."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(60_000)
    page.console_errors = []  # what the page logged as errors, for the failure messages
    page.on("console", lambda msg: msg.type == "error" and page.console_errors.append(msg.text[:300]))
    page.on("pageerror", lambda exc: page.console_errors.append(str(exc)[:300]))
    page.goto(f"{lab.url}/lab?token={lab.token}")
    page.wait_for_function("window.jupyterapp !== undefined && window.jupyterapp.shell !== undefined",
                           timeout=120_000)
    page.evaluate("async () => { await window.jupyterapp.started; await window.jupyterapp.restored; }")
    page.evaluate("() => { window.jupyterapp.shell.collapseLeft(); window.jupyterapp.shell.collapseRight(); }")
    page.evaluate(PROBE_JS.read_text())
    yield page
    context.close()
