"""MemoryExplorer: pick a model, world size (and GPUs per node, for hybrid sharding), strategy,
dtypes, batch and sequence length and see
the estimated per-rank breakdown; "measure" runs the same step for real and overlays it.

Built on ``fsdp_lab.viz.widgets.Explorer`` (controls + a figure redrawn on every change). The
figure comes from :meth:`MemoryExplorer.figure`, which also makes the static figure beside it.
"""

from __future__ import annotations

import html

import ipywidgets as widgets
import matplotlib.pyplot as plt
import torch
from IPython.display import display

from fsdp_lab.dist import simulated_world
from fsdp_lab.launch import launch
from fsdp_lab.memory.estimate import OPTIMIZERS, STRATEGIES, estimate
from fsdp_lab.memory.measure import MEASURABLE, measure_step
from fsdp_lab.models.llama import CONFIGS
from fsdp_lab.viz.memory_plots import plot_breakdown, plot_estimate_vs_measured
from fsdp_lab.viz.widgets import Explorer

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MEASURE_MAX_WORLD = 4  # real ranks on this machine; larger worlds are measured simulated (rank 0)
GPUS_PER_NODE = [1, 2, 4, 8, 16]


def measure(settings: dict, simulated: bool | None = None):
    """Measure rank 0's peak for ``settings`` (the explorer's control values) on the "cpu"-sized
    model given there; returns a MemoryResult. Runs ``world_size`` real ranks with
    ``fsdp_lab.launch`` up to MEASURE_MAX_WORLD, else (or with ``simulated=True``) rank 0 of a
    simulated world. QLoRA runs NF4 base weights with rank-8 adapters, as the estimate assumes.
    Raises ValueError for what cannot be measured (CPU offload, hybrid sharding, big models, a
    sequence longer than the model's ``max_seq_len``),
    and for an optimizer or gradient dtype other than the measured step's (AdamW, gradients in
    the parameters' dtype), so a measurement is never drawn beside the estimate of another setup.
    """
    if settings["cpu_offload"]:
        raise ValueError("measuring CPU offload is not wired into the explorer; "
                         "lab 09 measures an offloaded step")
    if settings.get("optimizer", "adamw") != "adamw":
        raise ValueError(f"measure runs plain AdamW, not {settings['optimizer']}: set optimizer to adamw")
    if settings.get("grad_dtype", "same") not in ("same", settings["param_dtype"]):
        raise ValueError(f"measure keeps gradients in the parameters' dtype ({settings['param_dtype']}), "
                         f"not {settings['grad_dtype']}: set grads to same")
    if not settings["model"].startswith("cpu"):
        raise ValueError(f"{settings['model']} is too big to run here: measure a 'cpu' config")
    longest = CONFIGS[settings["model"]].max_seq_len
    if settings["seq_len"] > longest:
        raise ValueError(f"seq len {settings['seq_len']} is past {settings['model']}'s max_seq_len ({longest}), "
                         f"which the model itself refuses: measure {longest} tokens or fewer")
    n = settings["world_size"]
    kwargs = dict(strategy=settings["strategy"], batch_size=settings["batch_size"], seq_len=settings["seq_len"],
                  param_dtype=DTYPES[settings["param_dtype"]],
                  activation_checkpointing=settings["activation_checkpointing"],
                  reshard_after_forward=settings["reshard_after_forward"], qlora=settings["qlora"])
    if settings["strategy"] not in MEASURABLE:
        raise ValueError(f"measuring {settings['strategy']} is not supported; use one of {', '.join(MEASURABLE)}")
    if n == 1:
        return measure_step(settings["model"], **kwargs)
    if simulated or (simulated is None and n > MEASURE_MAX_WORLD):
        with simulated_world(n):
            return measure_step(settings["model"], **kwargs)
    return launch(measure_step, settings["model"], world_size=n, timeout=300, **kwargs)[0]


def _node_size(settings: dict) -> int | None:
    """GPUs per shard group of ``fsdp1_hybrid_shard`` (None for other strategies); a world smaller
    than a node is one partly filled node."""
    if settings["strategy"] != "fsdp1_hybrid_shard":
        return None
    return min(settings.get("gpus_per_node", 8), settings["world_size"])


class MemoryExplorer:
    """Controls -> live estimated breakdown; "measure" overlays the measured rank-0 breakdown.

    ``MemoryExplorer(**initial)`` takes initial control values (names as in ``controls``).
    ``measured`` maps a settings key to the MemoryResult measured for it.
    """

    def __init__(self, **initial):
        c = {
            "model": widgets.Dropdown(options=list(CONFIGS), value="cpu", description="model"),
            "world_size": widgets.IntSlider(value=2, min=1, max=64, description="world size"),
            "strategy": widgets.Dropdown(options=list(STRATEGIES), value="fsdp2", description="strategy"),
            # fsdp1_hybrid_shard shards within a node and replicates across nodes
            "gpus_per_node": widgets.Dropdown(options=GPUS_PER_NODE, value=8, description="GPUs/node"),
            "param_dtype": widgets.Dropdown(options=list(DTYPES), value="float32", description="params"),
            "grad_dtype": widgets.Dropdown(options=["same"] + list(DTYPES), value="same", description="grads"),
            "optimizer": widgets.Dropdown(options=list(OPTIMIZERS), value="adamw", description="optimizer"),
            "batch_size": widgets.IntSlider(value=2, min=1, max=32, description="batch/rank"),
            "seq_len": widgets.Dropdown(options=[32, 64, 128, 256, 512, 1024, 2048, 4096, 8192], value=64,
                                        description="seq len"),
            "activation_checkpointing": widgets.Checkbox(value=False, description="checkpointing"),
            "cpu_offload": widgets.Checkbox(value=False, description="CPU offload"),
            "qlora": widgets.Checkbox(value=False, description="QLoRA"),
            "reshard_after_forward": widgets.Checkbox(value=True, description="reshard after fwd"),
        }
        for name, value in initial.items():
            if name not in c:
                raise ValueError(f"unknown control {name!r}; controls: {', '.join(c)}")
            c[name].value = value
        self.controls = c
        self.measured: dict[tuple, object] = {}
        # before the Explorer's own observers, so every draw after a model change has a length it supports
        c["model"].observe(lambda change: self._fit_seq_len(change["new"]), names="value")
        self.explorer = Explorer(c, self._render, title="Memory explorer (estimated per-rank peak)")
        self.measure_button = widgets.Button(description="measure", icon="flask")
        self.measure_button.on_click(lambda _b: self.measure())
        self.status = widgets.HTML()  # what the last "measure" did: about the settings it measured only
        for control in c.values():
            control.observe(lambda _change: setattr(self.status, "value", ""), names="value")
        self.widget = widgets.VBox([self.explorer.widget, widgets.HBox([self.measure_button, self.status])])

    def settings(self) -> dict:
        return self.explorer.values()

    def _fit_seq_len(self, model: str) -> None:
        """Lower the sequence length to the longest choice ``model`` supports (its max_seq_len)
        when a change of model leaves it longer; a longer one picked by hand stays, with a note."""
        longest = CONFIGS[model].max_seq_len
        seq_len = self.controls["seq_len"]
        if seq_len.value > longest:
            fitting = [n for n in seq_len.options if n <= longest]
            seq_len.value = max(fitting) if fitting else min(seq_len.options)

    @staticmethod
    def _key(settings: dict) -> tuple:
        return tuple(sorted(settings.items()))

    def estimate(self, settings: dict | None = None):
        """The Breakdown for the current (or given) settings. Raises ValueError for a setting the
        estimate refuses (e.g. a hybrid world that is not a whole number of nodes)."""
        s = settings or self.settings()
        grad = None if s["grad_dtype"] == "same" else DTYPES[s["grad_dtype"]]
        group = _node_size(s)
        if group is not None:
            if s["world_size"] % group:
                raise ValueError(f"fsdp1_hybrid_shard shards within a node: {s['world_size']} GPUs are not a whole "
                                 f"number of {group}-GPU nodes; pick a world size that is a multiple of "
                                 f"{group}, or other GPUs/node")
        return estimate(s["model"], world_size=s["world_size"], strategy=s["strategy"], shard_group_size=group,
                        param_dtype=DTYPES[s["param_dtype"]], grad_dtype=grad, optimizer=s["optimizer"],
                        batch_size=s["batch_size"], seq_len=s["seq_len"],
                        activation_checkpointing=s["activation_checkpointing"], cpu_offload=s["cpu_offload"],
                        qlora=s["qlora"],
                        # FSDP2's switch: other strategies leave the box alone, as they do GPUs/node
                        reshard_after_forward=s["reshard_after_forward"] or s["strategy"] != "fsdp2")

    def figure(self, settings: dict | None = None):
        """(Figure, text): estimated bars, beside measured ones when this setting was measured."""
        s = settings or self.settings()
        est = self.estimate(s)
        unit = "MiB" if est.total < 2**32 else "GiB"
        fig, ax = plt.subplots(figsize=(7, 4))
        measured = self.measured.get(self._key(s))
        title = f"{s['model']}, {s['strategy']}, N={s['world_size']}, batch {s['batch_size']} x {s['seq_len']}"
        if _node_size(s) is not None:
            title += f", {_node_size(s)} GPUs/node"
        if measured is None:
            plot_breakdown({"estimate": est}, ax=ax, unit=unit, title=title)
        else:
            plot_estimate_vs_measured(est, measured.peak, ax=ax, unit=unit, title=title)
        fig.tight_layout()
        text = est.table(unit)
        longest = CONFIGS[s["model"]].max_seq_len
        if s["seq_len"] > longest:
            text += (f"\nnote: seq len {s['seq_len']} is past {s['model']}'s max_seq_len ({longest}): an estimate "
                     "of what if; the model itself takes at most that, so measure refuses it")
        if measured is not None:
            text += f"\nmeasured peak (rank 0): {measured.peak_total / (2**20 if unit == 'MiB' else 2**30):.3f} {unit}"
        return fig, text

    def _render(self, **settings):
        return self.figure(settings)

    def measure(self, simulated: bool | None = None):
        """Measure the current setting (see :func:`measure`), store it and redraw."""
        s = self.settings()
        self.status.value = "measuring..."
        try:
            self.measured[self._key(s)] = measure(s, simulated=simulated)
            self.status.value = "measured (hatched bars)"
        except (ValueError, RuntimeError) as error:
            # a rank's failure comes with its traceback: the first line says what went wrong
            self.status.value = f"<span style='color:#b00'>{html.escape(str(error).splitlines()[0], quote=False)}</span>"
        self.explorer.update()

    def show(self) -> "MemoryExplorer":
        self.explorer.update()
        display(self.widget)
        return self
