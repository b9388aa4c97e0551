"""The lifecycle core against the independent reference model (tests/model/reference.py):
every outcome, pending answer, /v1 admission, status field and timer deadline must agree, on a
fake clock that jumps to each deadline and just either side of it.

Runs under the Hypothesis profile named by HYPOTHESIS_PROFILE (``ci`` by default: fixed seed,
400 programs of 50 steps; ``nightly``: 5000 of 100).
"""

from hypothesis.stateful import run_state_machine_as_test

from tests.model.profiles import model_profile
from tests.model.stateful import make_machine, tour, tour_size


def test_core_agrees_with_reference_model() -> None:
    run_state_machine_as_test(make_machine(), settings=model_profile())


def test_core_agrees_with_reference_model_on_the_tour_of_every_barrier_stage() -> None:
    """Every pause kind in every stage and every prelude, every route by every kind of caller
    and every internal event, then the next timer."""
    assert tour() == tour_size()
