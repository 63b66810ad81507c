"""dsa-train's data x context parallel trainer on a real (dp, cp) = (2, 2) gloo mesh of 4
spawned processes (cases in train_mesh_cases.py): DDP and FSDP2 against one process
running the same rows, and the error of a mesh the process group does not fit."""
import pytest

import train_mesh_cases
from _gloo import check_case

pytest.importorskip("transformers")

TIMEOUT_S = 300
WORLD = train_mesh_cases.D * train_mesh_cases.C


@pytest.mark.parametrize("case", [name for name, _ in train_mesh_cases.cases(WORLD)])
def test_train_mesh(case, tmp_path_factory):
    check_case("train_mesh_cases", WORLD, case, tmp_path_factory, TIMEOUT_S)
