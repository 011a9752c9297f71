"""Drive one notebook in JupyterLab the way a person does, and read what they would see.

Everything here goes through the page: menus are clicked, controls are moved with the
keyboard or mouse, and checks read the DOM that JupyterLab and the ipywidgets frontend
render. Waits are conditions polled by the browser (``wait_for_function``), each bounded.

Conventions the labs follow (see ``fsdp_lab.viz.widgets``): a lab's main widget carries the
CSS class ``fsdp-lab-main`` (``fsdp_lab.viz.widgets.MAIN_WIDGET_CLASS``), and it shows its
figure as an image inside itself.
"""

from __future__ import annotations

import json
import pathlib
import re
import time

from playwright.sync_api import TimeoutError as PlaywrightTimeout

MAIN_WIDGET_CLASS = "fsdp-lab-main"
ERROR_CLASS = "fsdp-lab-error"  # fsdp_lab.viz.widgets.ERROR_CLASS
WIDGET_MIME = "application/vnd.jupyter.widget-view+json"

# Which controls the test knows how to move, in the order a person meets them on screen.
CONTROL_SELECTOR = ", ".join([
    ".widget-slider .noUi-handle",          # IntSlider, FloatSlider, SelectionSlider
    ".widget-dropdown select",              # Dropdown
    ".widget-toggle-buttons button",        # ToggleButtons
    ".widget-radio-box input",              # RadioButtons
    ".widget-checkbox input",               # Checkbox
    ".widget-text input[type=number]",      # IntText, FloatText, BoundedIntText
])

# The kernel status JupyterLab shows in the notebook toolbar (one notebook is open at a time).
_KERNEL_STATUS_JS = """() => {
  const el = document.querySelector('.jp-Notebook-ExecutionIndicator');
  return el ? el.dataset.status : null;
}"""

# Run progress: how many code cells have an execution number, which are queued ("*").
_PROGRESS_JS = """() => {
  const cells = Array.from(document.querySelectorAll('.jp-Notebook .jp-CodeCell'));
  const prompts = cells.map(c => (c.querySelector('.jp-InputPrompt') || {}).textContent || '');
  const el = document.querySelector('.jp-Notebook-ExecutionIndicator');
  return {
    total: cells.length,
    done: prompts.filter(p => /\\[\\d+\\]/.test(p)).length,
    running: prompts.map((p, i) => p.includes('*') ? i : -1).filter(i => i >= 0),
    status: el ? el.dataset.status : null,
  };
}"""

# Everything a person would call broken in the outputs, as a list of strings. ``mayRaise``:
# indices of code cells tagged "raises-exception", whose error output is the lesson.
_PROBLEMS_JS = r"""(mayRaise) => {
  const problems = [];
  const cells = Array.from(document.querySelectorAll('.jp-Notebook .jp-CodeCell'));
  const label = (cell) => {
    const i = cells.indexOf(cell);
    const src = (cell.querySelector('.jp-InputArea-editor') || {}).innerText || '';
    return `code cell ${i + 1} (${src.trim().split('\n')[0].slice(0, 60)})`;
  };
  const visible = (el) => { const r = el.getBoundingClientRect(); return r.width > 0 && r.height > 0; };
  cells.forEach((cell) => {
    const prompt = (cell.querySelector('.jp-InputPrompt') || {}).textContent || '';
    if (!/\[\d+\]/.test(prompt)) problems.push(`${label(cell)} did not run (prompt "${prompt.trim()}")`);
    cell.querySelectorAll('.jp-OutputArea-output').forEach((out) => {
      const mime = out.dataset.mimeType || '';
      const text = out.textContent || '';
      if (mime === 'application/vnd.jupyter.stderr' && !mayRaise.includes(cells.indexOf(cell)) &&
          (/Traceback/.test(text) || /\b[A-Za-z]*Error\b/.test(text))) {
        problems.push(`${label(cell)} shows an error: ${text.trim().slice(0, 400)}`);
      }
      if (/Error displaying widget|Loading widget\.\.\./.test(text)) {
        problems.push(`${label(cell)} shows "${text.trim().slice(0, 80)}" instead of a widget`);
      }
      if (mime === 'text/plain' && /^\s*[A-Z]\w*\(children=\(/.test(text)) {
        problems.push(`${label(cell)} shows a widget as text (${text.trim().slice(0, 40)}...): ` +
                      'the ipywidgets JupyterLab extension is not loaded');
      }
      if (mime === '""" + WIDGET_MIME + r"""') {
        const root = out.querySelector('.jupyter-widgets');
        if (!root) problems.push(`${label(cell)}: widget output has no .jupyter-widgets element`);
        else if (!visible(root)) problems.push(`${label(cell)}: widget has zero size`);
      }
      out.querySelectorAll('img').forEach((img) => {
        if (!img.complete || img.naturalWidth === 0) {
          problems.push(`${label(cell)}: an image did not load`);
        }
        else if (!visible(img)) problems.push(`${label(cell)}: an image has zero size on the page`);
      });
    });
  });
  return problems;
}"""


# Remember whether the kernel went busy since now: a control change is handled by the
# kernel in milliseconds, quicker than polling could notice, so watch the indicator instead.
_WATCH_BUSY_JS = """() => {
  window.__fsdpLabSawBusy = false;
  if (window.__fsdpLabObserver) window.__fsdpLabObserver.disconnect();
  window.__fsdpLabObserver = new MutationObserver(() => {
    const el = document.querySelector('.jp-Notebook-ExecutionIndicator');
    if (el && el.dataset.status === 'busy') window.__fsdpLabSawBusy = true;
  });
  window.__fsdpLabObserver.observe(document.body,
    {subtree: true, childList: true, attributes: true, attributeFilter: ['data-status']});
}"""

# The src of the last loaded image inside widget ``w`` (its figure), or null.
_FIGURE_SRC_JS = """(w) => {
  const imgs = Array.from(w.querySelectorAll('img')).filter(i => i.complete && i.naturalWidth > 0);
  return imgs.length ? imgs[imgs.length - 1].src : null;
}"""

# "changed" once the widget's figure differs from ``before``; "handled" once the kernel went
# busy and is idle again (it has dealt with the change, whatever it did).
_CHANGED_OR_HANDLED_JS = """([w, before]) => {
  const src = (""" + _FIGURE_SRC_JS + """)(w);
  if (src !== null && src !== before) return 'changed';
  const el = document.querySelector('.jp-Notebook-ExecutionIndicator');
  return window.__fsdpLabSawBusy && el && el.dataset.status === 'idle' ? 'handled' : false;
}"""
_CHANGED_JS = """([w, before]) => { const src = (""" + _FIGURE_SRC_JS + """)(w);
                                 return src !== null && src !== before; }"""


class LabPageError(AssertionError):
    """What a person would see as broken; the message says where."""


def open_notebook(page, url: str, kernel_idle, timeout_s: float = 90.0) -> None:
    """Open ``url`` and wait until the notebook is shown and its kernel has started and is idle.

    ``kernel_idle()`` asks the server whether the notebook's kernel is idle: the page alone
    says "idle" before the kernel exists, and Run All would then ask which kernel to start.
    """
    page.goto(url, timeout=timeout_s * 1000)
    _wait_until_ready(page, kernel_idle, timeout_s)


def _wait_until_ready(page, kernel_idle, timeout_s: float) -> None:
    page.wait_for_selector(".jp-Notebook .jp-Cell", timeout=timeout_s * 1000)
    deadline = time.monotonic() + timeout_s
    while not kernel_idle():
        if time.monotonic() > deadline:
            raise LabPageError(f"the notebook's kernel did not start within {timeout_s:.0f} s")
        page.wait_for_timeout(200)  # the server has no push for this; ask again shortly
    page.wait_for_function(f"() => ({_KERNEL_STATUS_JS})() === 'idle'", timeout=timeout_s * 1000)


# Close every open document (marked saved first: the runs are in a throwaway copy, and an unsaved
# notebook would ask) and open ``path`` in the notebook editor, as File > Open does.
_OPEN_IN_APP_JS = """async (path) => {
  const app = window.jupyterapp;
  for (const w of Array.from(app.shell.widgets('main'))) { if (w.context) w.context.model.dirty = false; }
  await app.commands.execute('application:close-all');
  await app.commands.execute('docmanager:open', {path, factory: 'Notebook'});
}"""


def open_in_app(page, path: str, kernel_idle, timeout_s: float = 90.0) -> None:
    """In a page where JupyterLab already runs (started with ``expose_app_in_browser``), close
    what is open and open the notebook ``path`` (relative to the server's root); then wait as
    ``open_notebook`` does. Raises LabPageError when the page has no JupyterLab app to ask."""
    if not page.evaluate("() => Boolean(window.jupyterapp)"):
        raise LabPageError("window.jupyterapp is missing: start JupyterLab with "
                           "--LabApp.expose_app_in_browser=True")
    page.evaluate(_OPEN_IN_APP_JS, path)
    _wait_until_ready(page, kernel_idle, timeout_s)


class LabTab:
    """One browser page running JupyterLab, reused from notebook to notebook: loading JupyterLab
    takes seconds, opening a notebook in it does not. ``open(name)`` returns the page with the
    notebook ``name`` of ``server`` (a ``lab_server.LabServer``) open and its kernel idle;
    ``discard()`` closes the page, so the next ``open`` starts from a fresh one (after a failure,
    whatever state it left is gone)."""

    def __init__(self, context, server):
        self.context, self.server, self.page = context, server, None

    def open(self, name: str, timeout_s: float = 90.0):
        kernel_idle = lambda: self.server.kernel_idle(name)  # noqa: E731
        if self.page is None:
            self.page = self.context.new_page()
            open_notebook(self.page, self.server.notebook_url(name), kernel_idle, timeout_s)
        else:
            open_in_app(self.page, name, kernel_idle, timeout_s)
        return self.page

    def discard(self) -> None:
        if self.page is not None:
            self.page.close()
            self.page = None


def click_menu(page, menu: str, item: str, timeout_s: float = 10.0) -> None:
    """Click ``menu`` in JupyterLab's menu bar, then ``item`` in it (exact labels)."""
    for selector, label in ((".lm-MenuBar-itemLabel", menu), (".lm-Menu-itemLabel", item)):
        exact = re.compile(f"^{re.escape(label)}$")
        page.locator(selector, has_text=exact).first.click(timeout=timeout_s * 1000)


def run_all_cells(page, cell_timeout_s: float = 180.0) -> float:
    """Clear all outputs, Run > Run All Cells, and wait until the run stops; returns seconds.

    The run has stopped when the kernel is idle and no cell is queued. Raises LabPageError when
    one cell runs longer than ``cell_timeout_s``.
    """
    click_menu(page, "Edit", "Clear Outputs of All Cells")
    page.wait_for_function(f"() => ({_PROGRESS_JS})().done === 0", timeout=10_000)
    start = time.monotonic()
    click_menu(page, "Run", "Run All Cells")
    # Started: some cell is queued or numbered (a cleared cell's prompt is "[ ]").
    page.wait_for_function(
        f"() => {{ const p = ({_PROGRESS_JS})(); return p.running.length > 0 || p.done > 0; }}",
        timeout=30_000)
    one_more_done_or_stopped = f"""(before) => {{ const p = ({_PROGRESS_JS})();
        return p.done > before || (p.status === 'idle' && p.running.length === 0); }}"""
    while True:
        progress = page.evaluate(_PROGRESS_JS)
        if progress["status"] == "idle" and not progress["running"]:
            return time.monotonic() - start
        try:
            page.wait_for_function(one_more_done_or_stopped, arg=progress["done"],
                                   timeout=cell_timeout_s * 1000, polling=250)
        except PlaywrightTimeout:
            cell = progress["running"][0] + 1 if progress["running"] else progress["done"] + 1
            raise LabPageError(f"code cell {cell} ran longer than {cell_timeout_s:.0f} s "
                               f"(kernel {progress['status']})") from None


def wait_for_outputs_settled(page, timeout_s: float = 30.0) -> None:
    """Wait until no widget says "Loading widget..." and every output image has loaded."""
    try:
        page.wait_for_function("""() => {
            const outs = Array.from(document.querySelectorAll('.jp-OutputArea-output'));
            if (outs.some(o => /Loading widget\\.\\.\\./.test(o.textContent || ''))) return false;
            return Array.from(document.querySelectorAll('.jp-OutputArea-output img'))
                        .every(img => img.complete);
        }""", timeout=timeout_s * 1000, polling=250)
    except PlaywrightTimeout:
        pass  # the problems check that follows names what is still loading


def output_problems(page, may_raise: list[int] = ()) -> list[str]:
    """Errors, unrendered widgets and broken images in the notebook's outputs (strings).

    ``may_raise``: 0-based indices (among code cells) of cells whose error is expected.
    """
    return page.evaluate(_PROBLEMS_JS, list(may_raise))


def cells_tagged_raises_exception(notebook_path) -> list[int]:
    """0-based indices, among code cells, of the cells tagged "raises-exception" (nbval's tag)."""
    cells = [c for c in json.loads(pathlib.Path(notebook_path).read_text())["cells"]
             if c["cell_type"] == "code"]
    return [i for i, c in enumerate(cells)
            if "raises-exception" in c.get("metadata", {}).get("tags", [])]


def main_widget(page):
    """The lab's main widget: the last element with class fsdp-lab-main, else the last widget."""
    marked = page.locator(f".jp-OutputArea-output .{MAIN_WIDGET_CLASS}")
    if marked.count():
        return marked.last
    views = f'.jp-OutputArea-output[data-mime-type="{WIDGET_MIME}"] > .jupyter-widgets'
    widgets = page.locator(views)
    if widgets.count():
        return widgets.last
    raise LabPageError("no widget found: every lab shows a main widget (class "
                       f"{MAIN_WIDGET_CLASS}, added by fsdp_lab.viz.widgets.Explorer)")


def _figure_src(widget) -> str | None:
    return widget.evaluate(_FIGURE_SRC_JS)


def _move(control) -> str:
    """Change ``control`` by one step as a person would; returns what was done."""
    kind = control.evaluate("""(el) => {
        if (el.classList.contains('noUi-handle')) return 'slider';
        if (el.tagName === 'SELECT') return 'dropdown';
        if (el.tagName === 'BUTTON') return 'toggle';
        return el.type;  // radio, checkbox, number
    }""")
    if kind == "slider":
        now, top = (float(control.get_attribute(a)) for a in ("aria-valuenow", "aria-valuemax"))
        key = "ArrowLeft" if now >= top else "ArrowRight"
        control.focus()
        control.press(key)
        return f"slider {now:g} -> {key}"
    if kind == "dropdown":
        options = control.evaluate("(s) => Array.from(s.options).map(o => o.value)")
        current = control.input_value()
        if len(options) < 2:
            raise LabPageError(f"the main widget's dropdown has one option ({current!r})")
        target = next(o for o in options if o != current)
        control.select_option(target)
        return f"dropdown {current!r} -> {target!r}"
    if kind == "toggle":
        group = control.locator("xpath=..").locator("button:not(.mod-active)")
        group.first.click()
        return "toggle button"
    if kind == "number":
        value = float(control.input_value() or 0)
        control.fill(f"{value + 1:g}")
        control.press("Enter")
        return f"number {value:g} -> {value + 1:g}"
    control.click()  # radio button or checkbox
    return kind


def move_main_control(page, widget, timeout_s: float = 180.0) -> str:
    """Move the first control of ``widget`` and wait until its figure changes; returns a note.

    A widget that draws only on its Run button gets it pressed as a person would: first when
    it shows no figure yet, and again after the control moved (once the kernel has handled the
    change without redrawing). Raises LabPageError when the widget has no figure, no control,
    or the figure stays the same.
    """
    handle = widget.element_handle()
    run = widget.locator("button.jupyter-button", has_text="Run")

    def redrawn(before: str | None) -> bool:
        """True once the figure differs from ``before``; False when the kernel handled the
        event and the figure stayed the same."""
        try:
            outcome = page.wait_for_function(_CHANGED_OR_HANDLED_JS, arg=[handle, before],
                                             timeout=timeout_s * 1000, polling=100).json_value()
            if outcome == "changed":
                return True
            # The kernel is idle again; its last output may still be on its way into the page.
            page.wait_for_function(_CHANGED_JS, arg=[handle, before], timeout=5_000, polling=100)
            return True
        except PlaywrightTimeout:
            return False

    def click_run(before: str | None) -> bool:
        page.evaluate(_WATCH_BUSY_JS)
        run.first.click()
        return redrawn(before)

    note = ""
    if _figure_src(widget) is None and run.count():  # shown without drawing: press Run first
        click_run(None)
        note = "Run, then "
    before = _figure_src(widget)
    if before is None:
        raise LabPageError("the main widget shows no figure (no loaded <img> inside it)"
                           + (" even after pressing its Run button" if note else ""))
    controls = widget.locator(CONTROL_SELECTOR)
    if not controls.count():
        raise LabPageError("the main widget has no slider, dropdown, toggle buttons, radio buttons, "
                           "checkbox or number box")
    page.evaluate(_WATCH_BUSY_JS)
    note += _move(controls.first)
    changed = redrawn(before)
    if not changed and run.count():  # a widget that redraws only on its Run button
        note += ", then Run"
        changed = click_run(before)
    if changed:
        return note
    shown = widget_error_text(widget)
    raise LabPageError(f"moving the main widget's first control ({note}) did not change its figure"
                       + (f"; the widget shows {shown}" if shown else ""))


def widget_error_text(widget) -> str:
    """The error an Explorer shows (class ``fsdp-lab-error``), or text in ``widget`` that reads
    like a Python exception ("ValueError: ..."), else ""."""
    marked = widget.locator(f".{ERROR_CLASS}")
    if marked.count():
        return marked.first.inner_text()
    found = re.search(r"\b[A-Z]\w*(Error|Exception): .*", widget.inner_text())
    return found.group(0) if found else ""
