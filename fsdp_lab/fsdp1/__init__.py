"""fsdp_lab's FSDP1: the flat-parameter design, with PyTorch's public names, on CPU and GPU.

    from fsdp_lab.fsdp1 import FullyShardedDataParallel as FSDP, ShardingStrategy, ModuleWrapPolicy
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}))

Follow one parameter through its life: ``layout.py`` (where it sits, which slice a rank
keeps), ``flat_param.py`` (flatten, shard, gather, free), ``runtime.py`` (when: the hooks),
``flat_grad.py`` (its gradient: flat buffer, reduce-scatter, sharded ``.grad``).
``fully_sharded.py`` builds units and holds the public API, ``handle.py`` is the protocol
every flat parameter (and extensions such as NF4 weights) follows, ``wrap.py`` picks the
units, ``state_dict.py`` saves and loads (``optim_state.py`` the optimizer's state), ``clip.py`` clips, ``groups.py`` picks the ranks.
"""

from fsdp_lab.fsdp1.api import (BackwardPrefetch, CPUOffload, FullOptimStateDictConfig, FullStateDictConfig,
                                MixedPrecision, ShardedOptimStateDictConfig, ShardedStateDictConfig, ShardingStrategy,
                                StateDictSettings, StateDictType)
from fsdp_lab.fsdp1.dcp import dcp_state_dict, load_dcp_state_dict
from fsdp_lab.fsdp1.flat_param import FlatParamHandle
from fsdp_lab.fsdp1.fully_sharded import FullyShardedDataParallel
from fsdp_lab.fsdp1.handle import FlatHandle, register_handle_type
from fsdp_lab.fsdp1.layout import ShardedParam, padded_numel, shard_boundaries
from fsdp_lab.fsdp1.optim_state import load_dcp_optim_state_dict
from fsdp_lab.fsdp1.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy, transformer_auto_wrap_policy

__all__ = ["dcp_state_dict", "load_dcp_state_dict", "load_dcp_optim_state_dict", "FullyShardedDataParallel", "ShardingStrategy", "BackwardPrefetch", "CPUOffload", "MixedPrecision",
           "StateDictType", "ModuleWrapPolicy", "transformer_auto_wrap_policy", "size_based_auto_wrap_policy",
           "FlatParamHandle", "FlatHandle", "register_handle_type", "padded_numel", "shard_boundaries",
           "ShardedParam", "StateDictSettings", "FullStateDictConfig", "ShardedStateDictConfig",
           "FullOptimStateDictConfig", "ShardedOptimStateDictConfig"]
