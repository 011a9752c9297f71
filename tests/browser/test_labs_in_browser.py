"""Every lab as a learner meets it: opened in JupyterLab in a real (headless) browser.

The labs are opened one after another in one JupyterLab page (a lab that fails closes it, so the
next starts from a fresh one). For each ``labs/NN_*.ipynb``: clear outputs, Run > Run All Cells,
wait until the kernel is idle, then check what is on screen: no cell shows an error, every
widget is rendered with a non-zero size, every figure image has loaded; then move the first
control of the lab's main widget (class ``fsdp-lab-main``) and check its figure changes. A
screenshot of the main widget goes to ``tmp_artifacts/screenshots/<lab>.png`` (and
``<lab>-page.png`` of the whole page on failure).

Run:  python -m pytest -m browser tests/browser -q -rs
Needs Debian's Chromium and the playwright package (see conftest.py); skipped without them.
"""

from __future__ import annotations

import json
import pathlib
import time

import pytest

pytestmark = pytest.mark.browser

from lab_server import labs_dir

LAB_NOTEBOOKS = sorted(labs_dir().glob("[0-9][0-9]_*.ipynb"))
CELL_TIMEOUT_S = 180.0


def test_widgets_frontend_extension_installed():
    """ipywidgets' JupyterLab extension is where JupyterLab looks for it (else widgets show as text)."""
    from fsdp_lab.doctor import check_widgets_extension

    check = check_widgets_extension()
    assert check.status == "OK", f"{check.detail}; {check.fix}"


@pytest.mark.parametrize("notebook", LAB_NOTEBOOKS, ids=[p.stem for p in LAB_NOTEBOOKS])
def test_lab_runs_and_its_widget_responds(notebook, lab_tab, lab_server, artifacts):
    import lab_page

    timings = {}
    page = None
    try:
        start = time.monotonic()
        page = lab_tab.open(notebook.name)
        timings["open_s"] = time.monotonic() - start

        timings["run_all_s"] = lab_page.run_all_cells(page, cell_timeout_s=CELL_TIMEOUT_S)
        lab_page.wait_for_outputs_settled(page)
        may_raise = lab_page.cells_tagged_raises_exception(notebook)
        problems = lab_page.output_problems(page, may_raise)
        assert not problems, f"{notebook.name} after Run All Cells:\n  " + "\n  ".join(problems)

        widget = lab_page.main_widget(page)
        start = time.monotonic()
        note = lab_page.move_main_control(page, widget, timeout_s=CELL_TIMEOUT_S)
        timings["widget_s"] = time.monotonic() - start
        timings["moved"] = note
        problems = lab_page.output_problems(page, may_raise)
        assert not problems, (f"{notebook.name} after moving its widget ({note}):\n  "
                              + "\n  ".join(problems))
        shown = lab_page.widget_error_text(widget)
        assert not shown, f"{notebook.name}: after {note} the main widget shows {shown}"
        widget.scroll_into_view_if_needed()
        widget.screenshot(path=str(artifacts / f"{notebook.stem}.png"))
    except BaseException:
        try:
            failed_page = page if page is not None else lab_tab.page  # a failed open's page too
            if failed_page is not None:
                failed_page.screenshot(path=str(artifacts / f"{notebook.stem}-page.png"), full_page=True)
        finally:
            lab_tab.discard()  # the next lab starts from a fresh page
        raise
    finally:
        lab_server.shutdown_kernels()
        _record_timings(artifacts.parent / "browser_timings.json", notebook.stem, timings)


def _record_timings(path: pathlib.Path, stem: str, timings: dict) -> None:
    """Add this lab's timings (seconds) to the JSON table at ``path`` (tmp_artifacts/)."""
    table = json.loads(path.read_text()) if path.exists() else {}
    table[stem] = {k: round(v, 1) if isinstance(v, float) else v for k, v in timings.items()}
    path.write_text(json.dumps(table, indent=1, sort_keys=True))
