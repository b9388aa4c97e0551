"""Hypothesis profiles for the model tests: ``ci`` (the default: fixed seed, about 15 s on
two cores), ``quick`` (``make quick``: fewer, shorter programs) and ``nightly`` (longer),
selected by the HYPOTHESIS_PROFILE environment variable.

The profiles are registered here and applied only to the model tests (``model_profile()``), so
other test folders keep Hypothesis' defaults.
"""

import os

from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci",
    max_examples=400,
    stateful_step_count=50,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.register_profile(
    "quick",  # make quick: the same fixed seed, fewer and shorter programs
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)
settings.register_profile(
    "nightly",
    max_examples=5000,
    stateful_step_count=100,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    print_blob=True,
)


def model_profile() -> settings:
    """The profile named by HYPOTHESIS_PROFILE (``ci`` when unset)."""
    return settings.get_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
