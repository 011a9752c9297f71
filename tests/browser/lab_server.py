"""A throwaway JupyterLab server for the browser test.

It serves a temporary copy of ``labs/`` (so running the notebooks never rewrites the committed
ones) on 127.0.0.1 with a random token, and keeps every Jupyter setting it touches in its own
temporary directories, so the machine's own Jupyter configuration cannot change what the test
sees. The kernel is the ``python3`` kernel of this interpreter with the repository on
``PYTHONPATH``, so ``import fsdp_lab`` works without ``pip install -e .``.
"""

from __future__ import annotations

import json
import os
import pathlib
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request

# JupyterLab settings for a test run: every cell stays attached to the page (the default
# windowing leaves off-screen cells unrendered, so their outputs could not be measured),
# and no news or update checks, whose pop-ups could cover the notebook.
_LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
        "fetchNews": "false", "checkForUpdates": False},
}


def labs_dir() -> pathlib.Path:
    """The notebooks under test: labs/ of this repository, or $FSDP_LAB_BROWSER_LABS if set."""
    default = pathlib.Path(__file__).resolve().parents[2] / "labs"
    return pathlib.Path(os.environ.get("FSDP_LAB_BROWSER_LABS", default))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class LabServer:
    """``jupyter lab`` on ``root`` (a copy of the labs) at ``url``; use as a context manager.

    ``start_timeout`` (seconds) bounds the wait for the server to answer. Raises RuntimeError
    with the end of the server's log when it exits early or does not answer in time.
    """

    def __init__(self, labs_dir: pathlib.Path, work_dir: pathlib.Path, repo_root: pathlib.Path,
                 start_timeout: float = 90.0):
        self.work_dir = pathlib.Path(work_dir)
        self.root = self.work_dir / "labs"
        shutil.copytree(labs_dir, self.root, ignore=shutil.ignore_patterns(".ipynb_checkpoints"))
        self.repo_root = pathlib.Path(repo_root)
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = self.work_dir / "jupyterlab.log"
        self.start_timeout = start_timeout
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> "LabServer":
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _environment(self) -> dict:
        env = dict(os.environ)
        jupyter = self.work_dir / "jupyter"
        settings = jupyter / "lab-settings"
        for name, values in _LAB_SETTINGS.items():
            path = settings / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(values))
        env.update(
            JUPYTER_CONFIG_DIR=str(jupyter / "config"),
            JUPYTER_DATA_DIR=str(jupyter / "data"),
            JUPYTER_RUNTIME_DIR=str(jupyter / "runtime"),
            JUPYTERLAB_SETTINGS_DIR=str(settings),
            JUPYTERLAB_WORKSPACES_DIR=str(jupyter / "workspaces"),
            PYTHONPATH=os.pathsep.join(filter(None, [str(self.repo_root), env.get("PYTHONPATH")])),
        )
        return env

    def start(self) -> None:
        command = [
            sys.executable, "-m", "jupyterlab", "--no-browser",
            "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}",
            "--ServerApp.port_retries=0", f"--IdentityProvider.token={self.token}",
            f"--ServerApp.root_dir={self.root}",
            "--LabApp.news_url=", "--LabApp.check_for_updates_class=jupyterlab.NeverCheckForUpdate",
            # window.jupyterapp: the test opens each next notebook inside the page it has,
            # instead of loading JupyterLab again (about 5 s each on a 2-core machine)
            "--LabApp.expose_app_in_browser=True",
        ]
        if hasattr(os, "geteuid") and os.geteuid() == 0:  # containers and CI often run as root
            command.append("--allow-root")
        log = open(self.log_path, "wb")
        self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT,
                                        env=self._environment(), cwd=self.root,
                                        start_new_session=True)
        log.close()
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"JupyterLab exited with code {self.process.returncode} "
                                   f"before answering:\n{self.log_tail()}")
            try:
                self.api("GET", "/api/status", timeout=2)
                return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass  # not listening yet
            try:  # wait a moment, returning at once if the server exits
                self.process.wait(timeout=0.25)
            except subprocess.TimeoutExpired:
                pass
        self.stop()
        raise RuntimeError(f"JupyterLab did not answer on {self.url} within "
                           f"{self.start_timeout:.0f} s:\n{self.log_tail()}")

    def api(self, method: str, path: str, timeout: float = 10.0):
        """Call the server's REST API (``path`` like "/api/sessions"); returns decoded JSON or None."""
        request = urllib.request.Request(self.url + path, method=method,
                                         headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(request, timeout=timeout) as response:
            body = response.read()
        return json.loads(body) if body else None

    def notebook_url(self, name: str) -> str:
        """Address that opens ``name`` (relative to the labs copy) in a fresh JupyterLab workspace."""
        return f"{self.url}/lab/tree/{name}?reset&token={self.token}"

    def kernel_idle(self, name: str) -> bool:
        """Whether the notebook ``name`` has a session whose kernel has started and is idle."""
        for session in self.api("GET", "/api/sessions"):
            if session.get("path", "").endswith(name) and session.get("kernel"):
                return session["kernel"].get("execution_state") == "idle"
        return False

    def shutdown_kernels(self) -> None:
        """Stop every running kernel, so the next notebook has the CPU to itself."""
        for session in self.api("GET", "/api/sessions"):
            self.api("DELETE", f"/api/sessions/{session['id']}", timeout=30)
        for kernel in self.api("GET", "/api/kernels"):
            self.api("DELETE", f"/api/kernels/{kernel['id']}", timeout=30)

    def log_tail(self, lines: int = 40) -> str:
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return "\n".join(text.splitlines()[-lines:])

    def stop(self, timeout: float = 20.0) -> None:
        """Shut the server and its kernels down; kill the process group if that takes too long."""
        if self.process is None or self.process.poll() is not None:
            return
        try:
            self.api("POST", "/api/shutdown", timeout=5)
            self.process.wait(timeout=timeout)
        except (urllib.error.URLError, ConnectionError, TimeoutError, subprocess.TimeoutExpired):
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(timeout=timeout)
