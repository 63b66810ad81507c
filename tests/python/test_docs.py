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


def _block(language: str, after: str) -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index(f"```{language}\n", text.index(after)) + len(language) + 4
    return text[start:text.index("```\n", start)]


def test_readme_cpp_snippet_is_the_example_make_test_builds_and_runs():
    # tools/test_install.sh builds examples/indexer_example.cpp against the installed
    # package (find_package) and runs it; ctest runs it from the build tree.
    assert _block("cpp", "## C++") == (ROOT / "examples" / "indexer_example.cpp").read_text()


def test_readme_python_snippet_runs(tmp_path):
    import os
    import subprocess
    import sys
    script = tmp_path / "readme.py"
    script.write_text(_block("python", "## Python"))
    env = dict(os.environ, PYTHONPATH=str(ROOT / "python"))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "tensor(" in proc.stdout and "'works': True" in proc.stdout


def test_the_console_scripts_run_from_the_venv_make_sets_up():
    # tools/setup.sh (make run / make test) writes them, as `pip install .` would.
    import subprocess
    for name, words in (("dsa-train", "usage: dsa-train"), ("dsa-bench", "usage: dsa-bench"),
                        ("dsa-generate", "usage: dsa-generate")):
        script = ROOT / ".venv" / "bin" / name
        assert script.is_file(), f"{script}: run tools/setup.sh (make test does)"
        proc = subprocess.run([str(script), "--help"], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0 and words in proc.stdout, proc.stderr[-2000:]
