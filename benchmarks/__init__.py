"""Benchmarks: funcensemble against the ways people train N small models today.

Run ``python -m benchmarks.run`` (or ``make bench``); ``--help`` lists the options.
``workloads`` defines what is trained (S, L, C), ``methods`` the competing
implementations, ``measure`` the timing, FLOP and memory measurements, ``report``
the tables and the plot.
"""
