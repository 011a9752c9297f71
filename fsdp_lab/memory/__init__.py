"""Memory instruments: tags (what FSDP allocates), the measured tracker, the estimator."""

from fsdp_lab.memory.tags import CATEGORIES, category_of, current_scope, tag, tag_scope, untag

__all__ = ["CATEGORIES", "tag", "untag", "category_of", "tag_scope", "current_scope"]
