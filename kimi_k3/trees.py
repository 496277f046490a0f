"""Names for the leaves of a PyTree, shared by the optimizer's masks, the shardings' errors and
the checkpoint checks."""

from __future__ import annotations


def path_str(path) -> str:
    """'a/b/0/c' for a key path (dict keys, sequence indices, attributes)."""
    parts = []
    for k in path:
        for attr in ("key", "idx", "name"):
            if hasattr(k, attr):
                parts.append(str(getattr(k, attr)))
                break
        else:
            parts.append(str(k))
    return "/".join(parts)
