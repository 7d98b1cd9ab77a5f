"""Stable string keys for pytree leaves, as written into checkpoint files."""

import optree


def path_key(accessor: optree.PyTreeAccessor) -> str:
    """A leaf's path, e.g. ``['opt'].mu['w']``.

    Written out by hand rather than with ``accessor.codify()`` so that the keys in
    files do not change with optree's formatting.
    """
    parts = []
    for entry in accessor:
        if isinstance(entry, optree.NamedTupleEntry | optree.StructSequenceEntry):
            parts.append(f".{entry.field}")
        elif isinstance(entry, optree.GetAttrEntry):
            parts.append(f".{entry.name}")
        else:
            parts.append(f"[{entry.entry!r}]")
    return "".join(parts)
