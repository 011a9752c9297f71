"""FSDP2: per-parameter sharding with the API of ``torch.distributed.fsdp.fully_shard``.

Read in this order: ``param.py`` (one parameter's life), ``param_group.py`` (a group's
all-gather and reduce-scatter), ``fully_shard.py`` (the hooks that decide when),
``state_dict.py`` (full state dicts for export), ``dcp.py`` (DCP checkpoints of tensor
subclasses that shard themselves). See docs/fsdp2.md.
"""

from fsdp_lab.fsdp2.fully_shard import (CPUOffloadPolicy, FSDPModule, OffloadPolicy, UnshardHandle,
                                        fully_shard, register_fsdp_forward_method)
from fsdp_lab.fsdp2.param import FSDPParam
from fsdp_lab.fsdp2.param_group import FSDPParamGroup
from fsdp_lab.fsdp2.init import init_sharded
from fsdp_lab.fsdp2.state_dict import full_tensor, get_full_state_dict, load_full_state_dict, load_full_tensor
from fsdp_lab.fsdp2.dcp import dcp_state_dict, load_dcp_state_dict
from fsdp_lab.precision import MixedPrecisionPolicy

__all__ = ["fully_shard", "FSDPModule", "UnshardHandle", "MixedPrecisionPolicy", "OffloadPolicy",
           "CPUOffloadPolicy", "FSDPParam", "FSDPParamGroup", "get_full_state_dict", "load_full_state_dict",
           "full_tensor", "load_full_tensor", "init_sharded", "dcp_state_dict", "load_dcp_state_dict",
           "register_fsdp_forward_method"]
