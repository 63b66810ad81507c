"""The documentation lives in the repository: a clone has no ../shared, so no doc,
header, source or test cites a path outside the tree, and every relative link in
README.md and docs/ points at a file that exists."""
from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OUTSIDE = re.compile(r"\.\./shared|shared/(spec|research)/|/work/shared")


def _files():
    for pattern in ("README.md", "docs/*.md", "include/**/*.h", "src/**/*.[ch]*", "src/**/*.inc", "python/**/*.py",
                    "tests/**/*.py", "tests/**/*.cpp", "tests/**/*.h", "tools/*", "Makefile"):
        yield from (p for p in ROOT.glob(pattern) if p.is_file())


def test_nothing_cites_a_path_outside_the_repository():
    offenders = []
    for path in _files():
        if path.name == "test_docs.py":
            continue
        for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                offenders.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not offenders, "\n".join(offenders)


def test_relative_links_in_the_docs_resolve():
    broken = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" in target:
                continue
            if not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert not broken, "\n".join(broken)
