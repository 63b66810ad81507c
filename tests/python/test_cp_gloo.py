"""dsa.cp over real gloo process groups on the CPU (world sizes 2 and 4): every output and
gradient against the single-process run (cases in cp_gloo_cases.py, harness in _gloo.py)."""
import pytest

import cp_gloo_cases
from _gloo import check_case

TIMEOUT_S = 240          # whole group (both world sizes run well under a minute each on 2 cores)

CASES = [(w, name) for w in (2, 4) for name, _ in cp_gloo_cases.cases(w)]


@pytest.mark.parametrize("world,case", CASES, ids=[f"W{w}-{n}" for w, n in CASES])
def test_cp_gloo(world, case, tmp_path_factory):
    check_case("cp_gloo_cases", world, case, tmp_path_factory, TIMEOUT_S)
