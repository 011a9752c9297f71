"""Thin ipywidgets wrappers around the plot functions.

``Explorer`` is the one pattern every lab widget follows: a few controls, and a render
function ``render(**values) -> Figure`` (or ``(Figure, text)``) that runs the real thing
and draws it. Changing a control re-renders; the last figure is kept as PNG bytes
(``last_png``) so tests and the browser check can see that it changed. Widget state is
not saved in notebooks, so every lab shows a static figure from the same render
function beside the widget. Widgets built on ``Explorer`` (``MemoryExplorer`` in
``fsdp_lab.viz.memory_widgets``) import this module; it imports none of them.
"""

from __future__ import annotations

import io
from typing import Callable

import ipywidgets as widgets
import matplotlib.pyplot as plt
from IPython.display import display

# CSS class on each lab's main widget, so the browser test can find it.
MAIN_WIDGET_CLASS = "fsdp-lab-main"
ERROR_CLASS = "fsdp-lab-error"  # on the message an Explorer shows when its render raised
STALE_CLASS = "fsdp-lab-stale"  # on the note that the figure shown is of earlier settings


class Explorer:
    """Controls plus a figure that is redrawn by ``render(**values)`` whenever a control changes.

    ``controls``: name -> ipywidgets value widget (the name is the keyword ``render`` gets).
    ``render`` returns a matplotlib Figure or (Figure, text). Errors raised by ``render``
    are shown in the output area as text instead of breaking the widget, and the figure of
    earlier settings is taken away. With ``auto=False`` (a render that runs ranks) only the
    Run button renders; changing a control then marks the figure shown as out of date.
    """

    def __init__(self, controls: dict[str, widgets.ValueWidget], render: Callable, *,
                 title: str = "", auto: bool = True):
        self.controls = controls
        self.render = render
        self.output = widgets.Output(layout=widgets.Layout(min_height="300px"))
        self.text = widgets.HTML()
        self.button = widgets.Button(description="Run", button_style="primary", icon="play")
        self.button.on_click(lambda _b: self.update())
        self.last_png: bytes | None = None
        self.last_text = ""
        self.auto = auto
        self.stale = widgets.HTML()  # auto=False: says when the figure is not of the settings shown
        header = [widgets.HTML(f"<b>{title}</b>")] if title else []
        hint = [] if auto else [widgets.HTML("<i>change the settings, then press Run</i>")]
        panel = widgets.VBox(header + list(controls.values()) + [self.button] + hint,
                             layout=widgets.Layout(min_width="320px"))
        self.widget = widgets.HBox([panel, widgets.VBox([self.stale, self.output, self.text])])
        self.widget.add_class(MAIN_WIDGET_CLASS)
        for control in controls.values():
            control.observe(lambda _change: self.update() if auto else self._mark_stale(), names="value")

    def _mark_stale(self) -> None:
        if self.last_png is not None or self.last_text:
            self.stale.value = (f"<b class='{STALE_CLASS}' style='color:#a60'>settings changed: the results below "
                                "are for the previous ones; press Run</b>")

    def values(self) -> dict:
        return {name: control.value for name, control in self.controls.items()}

    def update(self) -> None:
        """Run ``render`` with the current control values and show its figure."""
        self.button.disabled = True
        # said while a render (ranks launched, a step trained) runs: the figure below is the last one
        self.stale.value = "<i>running...</i>"
        try:
            self._draw(self.render(**self.values()))
        except Exception as error:  # shown to the learner, not raised into the event loop
            # no figure of earlier settings beside the error: it would read as this setting's
            self.output.clear_output()
            self.last_png, self.last_text = None, f"{type(error).__name__}: {error}"
            self.text.value = f"<pre class='{ERROR_CLASS}' style='color:#b00'>{self.last_text}</pre>"
        finally:
            self.stale.value = ""
            self.button.disabled = False

    def _draw(self, result) -> None:
        fig, text = result if isinstance(result, tuple) else (result, "")
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=80, bbox_inches="tight")
        self.last_png, self.last_text = buf.getvalue(), text
        self.output.clear_output(wait=True)
        with self.output:
            display(fig)
        plt.close(fig)
        self.text.value = f"<pre style='white-space:pre; overflow-x:auto'>{text}</pre>" if text else ""

    def show(self, first=None) -> "Explorer":
        """Display the widget with a figure; returns self.

        ``first``: what ``render`` returned for the controls' current values (a figure, or
        ``(figure, text)``), when a cell above already computed it; None renders once here.
        """
        if first is None:
            self.update()
        else:
            self._draw(first)
        display(self.widget)
        return self

    def _ipython_display_(self) -> None:
        display(self.widget)

