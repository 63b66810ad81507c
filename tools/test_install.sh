#!/usr/bin/env bash
# Checks the two ways users install dsa: `pip install .` into a scratch folder
# (then imports it and runs a call), and `cmake --install` + find_package(dsa)
# from a separate consumer project.
set -euo pipefail
cd "$(dirname "$0")/.."
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# pip's build takes the compiler Python was built with (g++) unless CXX says otherwise;
# with the one of build/ it compiles the library exactly as `make build` did, so the
# compiler cache (ccache, CMakeLists.txt) serves every object (67 s -> 10 s on 2 cores).
cxx=$(sed -n 's/^CMAKE_CXX_COMPILER:FILEPATH=//p' build/CMakeCache.txt 2>/dev/null || true)
if [ -n "$cxx" ] && [ -z "${CXX:-}" ]; then export CXX="$cxx"; fi
.venv/bin/python -m pip install -q --no-deps --no-build-isolation --target "$tmp/site" .
(cd "$tmp" && PYTHONPATH="$tmp/site" "$OLDPWD/.venv/bin/python" -c "
import dsa, torch
assert dsa.__file__.startswith('$tmp/site'), dsa.__file__
assert all(b['works'] for b in dsa.backends() if b['built'])
i = dsa.dsa_indexer(torch.randn(5, 2, 8), torch.randn(5, 8), torch.ones(5, 2), topk=2)
assert i.shape == (5, 2)
print('pip install . ok:', dsa.__file__)
")
# The console scripts pip wrote resolve to functions that exist and parse their options.
for script in dsa-train dsa-bench dsa-generate; do
  (cd "$tmp" && PYTHONPATH="$tmp/site" "$tmp/site/bin/$script" --help >/dev/null) || {
    echo "console script $script --help failed" >&2
    exit 1
  }
done
echo "console scripts ok"

cmake --install build --prefix "$tmp/prefix" >/dev/null
cmake -S examples/consumer -B "$tmp/consumer" -G Ninja -DCMAKE_PREFIX_PATH="$tmp/prefix" >/dev/null
cmake --build "$tmp/consumer" >/dev/null
"$tmp/consumer/dsa_consumer" >/dev/null
echo "find_package(dsa) ok"
