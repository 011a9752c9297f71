"""fsdp_lab's FSDP1: the flat-parameter design, with PyTorch's public names, on CPU and GPU.

    from fsdp_lab.fsdp1 import FullyShardedDataParallel as FSDP, ShardingStrategy, ModuleWrapPolicy
    model = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}))

Follow one parameter through its life in three files: ``flat_param.py`` (flatten, pad,
shard, gather, free), ``fully_sharded.py`` (when: the hooks), ``flat_grad.py`` (its
gradient: flat buffer, reduce-scatter, sharded ``.grad``). ``wrap.py`` picks the units,
``state_dict.py`` saves and loads, ``groups.py`` picks the ranks.
"""

from fsdp_lab.fsdp1.api import BackwardPrefetch, CPUOffload, MixedPrecision, ShardingStrategy, StateDictType
from fsdp_lab.fsdp1.flat_param import FlatParamHandle, padded_numel, shard_boundaries
from fsdp_lab.fsdp1.fully_sharded import FullyShardedDataParallel
from fsdp_lab.fsdp1.state_dict import ShardedParam
from fsdp_lab.fsdp1.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy, transformer_auto_wrap_policy

__all__ = ["FullyShardedDataParallel", "ShardingStrategy", "BackwardPrefetch", "CPUOffload", "MixedPrecision",
           "StateDictType", "ModuleWrapPolicy", "transformer_auto_wrap_policy", "size_based_auto_wrap_policy",
           "FlatParamHandle", "padded_numel", "shard_boundaries", "ShardedParam"]
