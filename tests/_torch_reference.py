"""Whether PyTorch's own ``fully_shard``, the reference several tests compare ours with, runs on
CPU ranks with the torch installed: torch 2.6's does not (its CPU stream has no
``record_event``), torch 2.11 and 2.13 do."""

import pytest
import torch

TORCH_FSDP2_ON_CPU = hasattr(torch.cpu.Stream(), "record_event")

needs_torch_fsdp2_on_cpu = pytest.mark.skipif(
    not TORCH_FSDP2_ON_CPU,
    reason=f"torch {torch.__version__}'s fully_shard does not run on CPU ranks (its CPU stream has no "
           "record_event): no reference to compare with")
