"""Workshop mode: the learner writes the interesting lines, the lab checks them.

Layout (one module per lab, so labs gain exercises without touching each other):

* ``checking.py``: the framework. ``@checker(exercise, hint)`` turns a function that
  returns ``correct(message)`` or ``mistake(name, message, hint)`` into a checker that
  returns a :class:`Verdict` and never raises: a stub gives "not solved yet" and the hint,
  an error or a hang a one-line verdict, never a traceback.
* ``files.py``: ``lab_files("NN_name")``: the lab's ``labs/figures/NN_name/`` from either
  copy of the notebook (``labs/`` or ``labs/solutions/``); the solution copy never
  overwrites a figure.
* ``labNN.py``: the checkers of lab NN (``check_<exercise>(answer) -> Verdict``), each
  against an independent reference: single-process training, a formula, fsdp_lab's own code;
  and the figure, table and text helpers the lab's notebook calls.
* ``measure.py``: bytes on the wire of timeline events; ``repeats.py``: timed runs repeated
  (mean ± sd, whether two runs differ beyond the spread).
* ``zero.py``: DDP and ZeRO-1/2/3 by hand, lab 03's exercises and reference.
* ``cli.py``: ``fsdp-lab lab list | reset NN | solution NN``.

In a lab source (``labs/src/NN_name.py``) an exercise is an ``exercise(...)`` cell whose
solution lines sit between ``### BEGIN SOLUTION`` and ``### END SOLUTION`` and whose stub is
a ``### STUB raise NotImplementedError("...")`` line; the cell after it calls the checker:

    code("from fsdp_lab.workshop import lab00\\nlab00.check_shard_range(shard_range)")

``labs/src/nbbuild.py`` builds the learner's notebook (stubs) and ``labs/solutions/`` (solved)
from that one source. ``tests/test_workshop*.py`` feed every checker its stub, its solution
and typical wrong answers.
"""

from fsdp_lab.workshop.checking import CORRECT, NOT_SOLVED, WRONG, Verdict, checker, correct, mistake
from fsdp_lab.workshop.files import LabFiles, lab_files

__all__ = ["CORRECT", "NOT_SOLVED", "WRONG", "LabFiles", "Verdict", "checker", "correct",
           "lab_files", "mistake"]
