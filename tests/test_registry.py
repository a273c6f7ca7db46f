import relpos
from tests.helpers import SCHEME_SPECS


def test_every_registered_scheme_is_covered_by_the_specs():
    assert {s["name"] for s in SCHEME_SPECS} == set(relpos.SCHEMES)
