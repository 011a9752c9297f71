"""Timed runs repeated on fresh ranks: one value per repeat, mean ± standard deviation, error bars.

Times vary from run to run (other processes, the scheduler, gloo's threads), so lab 07 runs the
same ``compare`` configurations several times and calls a difference real only when it is larger
than the spread. Counts and bytes do not vary; these helpers are for the numbers that do.
"""

from __future__ import annotations

import statistics

PHASES = ("forward", "backward", "optimizer", "exposed_comm", "idle", "window")


def spread(values: list[float]) -> str:
    """``values`` as "mean ± standard deviation" (two decimals). Raises
    statistics.StatisticsError for fewer than two values."""
    return f"{statistics.mean(values):7.2f} ± {statistics.stdev(values):5.2f}"


class Repeats(list):
    """The tables of several ``compare`` calls, first table first; iterating gives the tables.
    The first table may hold more runs than the others: measure only runs that every table holds.
    """

    def measured(self, name: str, key: str) -> list[float]:
        """One value per table for run ``name``: ``key`` is a phase of ``Timeline.phase_summary()``
        (milliseconds, mean over ranks) or a row field (``step_ms``, ``peak_total_mib`` ...).
        Raises KeyError for a run that a table lacks or an unknown key."""
        values = []
        for table in self:
            row = table.row(name)
            if key in row["phases"][0]:
                values.append(1e3 * statistics.mean(p[key] for p in row["phases"].values()))
            else:
                values.append(row[key])
        return values

    def apart(self, a: str, b: str, key: str) -> bool:
        """Whether runs ``a`` and ``b`` differ in ``key`` by more than the run-to-run spread: the
        means lie further apart than the two standard deviations together."""
        va, vb = self.measured(a, key), self.measured(b, key)
        return abs(statistics.mean(va) - statistics.mean(vb)) > statistics.stdev(va) + statistics.stdev(vb)

    def phase_table(self, names: list[str], phases=PHASES) -> str:
        """Milliseconds per phase, "mean ± sd" over the tables, one line per run."""
        head = f"{'run (ms, mean ± sd of ' + str(len(self)) + ' runs)':28} "
        lines = [head + " ".join(f"{p:>15}" for p in phases)]
        for name in names:
            lines.append(f"{name:28} " + " ".join(f"{spread(self.measured(name, p)):>15}" for p in phases))
        return "\n".join(lines)

    def error_bars(self, names: list[str], keys: list[str], title: str, height: float = 3.0):
        """A matplotlib Figure, 10 inches wide and ``height`` inches high, of horizontal bars: per
        run, one bar per key (mean over the tables) with a line of ± one standard deviation."""
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(10, height))
        width = 0.8 / len(keys)
        for j, key in enumerate(keys):
            values = [self.measured(n, key) for n in names]
            ax.barh([i + j * width for i in range(len(names))], [statistics.mean(v) for v in values],
                    height=width, xerr=[statistics.stdev(v) for v in values], capsize=3, label=key)
        ax.set_yticks([i + width * (len(keys) - 1) / 2 for i in range(len(names))])
        ax.set_yticklabels(names)
        ax.invert_yaxis()
        ax.set_xlabel(f"ms per step (mean over ranks; bar = mean, line = ± 1 sd over {len(self)} runs)")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        ax.set_title(title)
        fig.tight_layout()
        return fig
