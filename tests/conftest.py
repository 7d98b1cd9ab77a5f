"""Hypothesis settings profiles for the property tests (tests/test_properties.py).

- ``ci`` (the default): fixed seed (``derandomize=True``), so every run generates the
  same cases; sized to finish in about two minutes on 2 cores (120 cases a property:
  their 220 took a third of CI's make test).
- ``long``: random seeds and many more cases per property, for a search before a
  release: ``HYPOTHESIS_PROFILE=long pytest tests/test_properties.py``.

See tests/README.md.
"""

import os

from hypothesis import HealthCheck, settings

# Generated cases build and run small ensembles (milliseconds to a second each, more
# on a loaded machine): no per-case deadline, and no "too slow" health check.
_COMMON = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.data_too_large],
    "print_blob": True,
}
settings.register_profile("ci", max_examples=120, derandomize=True, database=None, **_COMMON)
settings.register_profile("long", max_examples=5000, **_COMMON)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
