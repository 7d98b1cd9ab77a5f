"""``PerShard``: one value per shard of a ``ShardedEnsemble``."""


class PerShard(tuple):
    """One value per shard of a [`ShardedEnsemble`][funcensemble.distributed.ShardedEnsemble].

    [`ShardedEnsemble.map`][funcensemble.distributed.ShardedEnsemble.map] returns one,
    and passes the k-th item of a ``PerShard`` argument to shard k as it is (where a
    plain argument is copied to every shard's device). Optimizer states, per-shard
    optimizers and outputs left on their devices are ``PerShard`` values.

    Example:
        >>> import funcensemble as fe
        >>> pairs = fe.distributed.PerShard([(1, "a"), (2, "b")])
        >>> numbers, letters = pairs.unzip()
        >>> numbers, letters
        (PerShard((1, 2)), PerShard(('a', 'b')))
    """

    __slots__ = ()

    def unzip(self) -> tuple["PerShard", ...]:
        """Turn per-shard tuples into a tuple of ``PerShard`` values, one per field."""
        if not self:
            return ()
        lengths = {len(item) if isinstance(item, tuple) else None for item in self}
        if len(lengths) != 1 or None in lengths:
            raise ValueError(
                "PerShard.unzip: every shard's value must be a tuple of one length, got "
                f"{[type(item).__name__ for item in self]} with lengths {sorted(lengths, key=str)}."
            )
        return tuple(PerShard(field) for field in zip(*self, strict=True))

    def __repr__(self) -> str:
        return f"PerShard({tuple(self)!r})"
