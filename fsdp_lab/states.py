"""The states both FSDPs move through, as enums with asserted transitions.

Modelled on PyTorch's ``TrainingState``, ``HandleTrainingState`` and ``ShardedState``
(``torch/distributed/fsdp/_common_utils.py`` and ``_fully_shard/_fsdp_common.py``) and their
``_assert_in_states``. Three independent things are tracked:

* ``ShardedState`` — where a flat parameter's (FSDP1) or a group's (FSDP2) data is:

      SHARDED --unshard()--> GATHERING --wait_for_unshard()--> UNSHARDED --reshard()--> SHARDED

* ``TrainingState`` — what one FSDP1 unit or one FSDP2 group is doing in a step:

      IDLE --pre-forward--> FORWARD --post-forward--> IDLE --pre-backward--> BACKWARD_PRE
           --post-backward--> BACKWARD_POST --end of backward--> IDLE
      IDLE --summon_full_params--> SUMMON_FULL_PARAMS --exit--> IDLE

* ``StepState`` — whether the root is inside a backward (its end-of-backward callback is
  queued on the autograd engine):  IDLE --first pre-backward--> IN_BACKWARD --callback--> IDLE

Every layer that keeps one of them has a ``reset()`` that puts it back to its start, which is
how ``recover_from_error`` brings a model back after an exception mid-step.
"""

from __future__ import annotations

import enum

__all__ = ["ShardedState", "TrainingState", "StepState", "assert_in_states"]


class ShardedState(enum.Enum):
    """Where the data of a flat parameter (FSDP1) or a parameter group (FSDP2) is."""

    SHARDED = enum.auto()     # only this rank's shard exists; gathered storage is freed
    GATHERING = enum.auto()   # an all-gather has been issued (or is about to be) and not waited for
    UNSHARDED = enum.auto()   # the full data is there and the modules may use it


class TrainingState(enum.Enum):
    """What one FSDP1 unit or one FSDP2 group is doing in the current step."""

    IDLE = enum.auto()
    FORWARD = enum.auto()
    BACKWARD_PRE = enum.auto()        # its pre-backward ran: parameters gathered for its backward
    BACKWARD_POST = enum.auto()       # its gradients were handed to the reduce-scatter
    SUMMON_FULL_PARAMS = enum.auto()


class StepState(enum.Enum):
    """Whether the root is inside a backward pass."""

    IDLE = enum.auto()
    IN_BACKWARD = enum.auto()


def assert_in_states(current: enum.Enum, *allowed: enum.Enum, where: str) -> None:
    """Raise AssertionError naming ``where`` unless ``current`` is one of ``allowed``
    (an FSDP bug or a step interrupted without ``recover_from_error``)."""
    if current not in allowed:
        names = ", ".join(a.name for a in allowed)
        raise AssertionError(f"{where}: expected state {names}, found {current.name}; if an exception "
                             f"interrupted the step, call recover_from_error() on the model first")
