"""Fixtures for the browser test: one JupyterLab server and one headless Chromium per session.

The browser is Debian's Chromium (``apt-get install -y chromium``, see ``.ci/browser-setup.sh``)
driven by the Python ``playwright`` package; nothing is downloaded at run time. Without either,
the tests are skipped with a message that says what to install. Set
``FSDP_LAB_REQUIRE_BROWSER=1`` (CI does) to make that a failure instead of a skip, and
``FSDP_LAB_CHROMIUM`` to use a Chromium binary elsewhere than /usr/bin/chromium, and
``FSDP_LAB_BROWSER_LABS`` to test the notebooks of another folder instead of labs/.
"""

from __future__ import annotations

import os
import pathlib
import tempfile

import pytest

REPO = pathlib.Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "tmp_artifacts"
CHROMIUM = pathlib.Path(os.environ.get("FSDP_LAB_CHROMIUM", "/usr/bin/chromium"))

# Flags for a headless Chromium on a machine without a display, GPU or outside network:
# without the background-networking ones a closed network refuses its many connections.
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-dev-shm-usage",
]
INSTALL_HINT = ("install it with `sudo apt-get install -y chromium fonts-dejavu-core` and "
                "`pip install playwright` (Python package only; no `playwright install`), "
                "or run `.ci/browser-setup.sh`")


def missing_or_skip(reason: str) -> None:
    """Skip with ``reason``, or fail when FSDP_LAB_REQUIRE_BROWSER=1 says the browser must be there."""
    if os.environ.get("FSDP_LAB_REQUIRE_BROWSER") == "1":
        pytest.fail(f"{reason} (FSDP_LAB_REQUIRE_BROWSER=1)", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="session")
def chromium():
    """A headless Chromium (Playwright Browser); skips when the browser or driver is missing."""
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        missing_or_skip(f"the browser test needs the `playwright` Python package: {INSTALL_HINT}")
    if not CHROMIUM.exists():
        missing_or_skip(f"the browser test needs Chromium at {CHROMIUM}: {INSTALL_HINT}")
    with tempfile.TemporaryDirectory(prefix="fsdp-lab-chromium-") as profile:
        with sync_playwright() as playwright:
            # A persistent context is how Playwright takes a fresh --user-data-dir of our own.
            context = playwright.chromium.launch_persistent_context(
                profile, executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS,
                viewport={"width": 1400, "height": 1000}, device_scale_factor=1)
            yield context
            context.close()


@pytest.fixture(scope="session")
def lab_server(tmp_path_factory):
    """JupyterLab serving a temporary copy of labs/ (the committed notebooks stay untouched)."""
    pytest.importorskip("jupyterlab", reason="the browser test needs JupyterLab: "
                                             "pip install -e '.[lab]'")
    from fsdp_lab.doctor import check_widgets_extension

    extension = check_widgets_extension()
    if extension.status == "FAIL":
        pytest.fail(f"ipywidgets' JupyterLab extension: {extension.detail}; {extension.fix}",
                    pytrace=False)
    from lab_server import LabServer, labs_dir

    with LabServer(labs_dir(), tmp_path_factory.mktemp("jupyterlab"), REPO) as server:
        yield server


@pytest.fixture(scope="session")
def artifacts() -> pathlib.Path:
    """tmp_artifacts/screenshots/ under the repository (git-ignored), created on demand."""
    path = ARTIFACTS / "screenshots"
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def lab_tab(chromium, lab_server):
    """The page the labs are opened in, one after another (``lab_page.LabTab``)."""
    from lab_page import LabTab

    tab = LabTab(chromium, lab_server)
    yield tab
    tab.discard()
