"""How members are computed batched: the MLP fast path and calls vmap cannot batch as written."""
