"""Heterogeneous ensembles: members of several architectures, one vectorized group each."""
