"""The transformers patch under context parallelism (patch(model, cp_group=...)): real gloo
groups of W = 2 and 3 spawned processes, tiny DeepSeek-V4 / V3.2 models, against the
single-process patched model and the unpatched one (cases in cp_model_cases.py)."""
import pytest

import cp_model_cases
from _gloo import check_case

TIMEOUT_S = 240

CASES = [(w, name) for w in (2, 3) for name, _ in cp_model_cases.cases(w)]


@pytest.mark.parametrize("world,case", CASES, ids=[f"W{w}-{n}" for w, n in CASES])
def test_cp_model(world, case, tmp_path_factory):
    check_case("cp_model_cases", world, case, tmp_path_factory, TIMEOUT_S)
