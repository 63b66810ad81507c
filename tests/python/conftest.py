"""`make test` runs this suite in two pytest-xdist workers, one file per worker at a time
(--dist loadfile --no-loadscope-reorder), handing out files in collection order. The
files below take one to three minutes each on a 2-core machine (dsa-train, dsa-bench and
torchrun children): collected first, they start first and the short files fill the other
worker, instead of one long file running alone at the end. A plain `pytest` run keeps
the usual order."""
from __future__ import annotations

LONG_FILES_FIRST = ("test_train.py", "test_bench.py", "test_train_cp.py", "test_generate_cli.py")


def pytest_collection_modifyitems(session, config, items):
    if not hasattr(config, "workerinput"):  # not an xdist worker
        return
    rank = {name: i for i, name in enumerate(LONG_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES_FIRST)))  # stable: files keep their order
