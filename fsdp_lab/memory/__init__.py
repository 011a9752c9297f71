"""Memory instruments: tags (what FSDP allocates), the measured tracker, the estimator."""

from fsdp_lab.memory.tags import CATEGORIES, category_of, current_scope, tag, tag_scope, untag

__all__ = ["CATEGORIES", "tag", "untag", "category_of", "tag_scope", "current_scope"]

from fsdp_lab.memory.estimate import Breakdown, estimate  # noqa: E402
from fsdp_lab.memory.measure import measure_step  # noqa: E402
from fsdp_lab.memory.results import MemoryResult, merge_ranks  # noqa: E402
from fsdp_lab.memory.tracker import MemoryTracker  # noqa: E402

__all__ += ["MemoryTracker", "MemoryResult", "merge_ranks", "estimate", "Breakdown", "measure_step"]
