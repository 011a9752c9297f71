"""Figures (pure matplotlib, each takes ``ax=None`` and returns the Axes) and widgets.

Plot functions never need a display and are tested headless; widgets live in
``fsdp_lab.viz.widgets`` and are thin ipywidgets wrappers around these plots.
"""

from fsdp_lab.viz.collective_plots import plot_collective
from fsdp_lab.viz.memory_plots import plot_breakdown, plot_estimate_vs_measured, plot_memory_curve
from fsdp_lab.viz.timeline_plots import plot_phase_breakdown, plot_timeline

__all__ = ["plot_breakdown", "plot_collective", "plot_estimate_vs_measured", "plot_memory_curve",
           "plot_phase_breakdown", "plot_timeline"]
