"""One measurement in a fresh interpreter, so that its peak memory (VmHWM) is its own:
what dsa-train --compare, dsa.train.long_context and dsa-generate --compare run each
configuration in; and the token-count lists their command lines take."""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from pathlib import Path


def run_json_child(args: list, out_flag: str, timeout_s: float, show_stderr: bool = False) -> dict:
    """Runs ``python <args> <out_flag> PATH``, which must write its result JSON to PATH.
    Returns that dict, or ``{"error": why}`` (over time, killed, a non-zero exit code
    with the last output line). ``show_stderr`` passes the child's stderr through (its
    progress bar), else it is kept for the error."""
    with tempfile.TemporaryDirectory(prefix="dsa-child-") as tmp:
        out = Path(tmp) / "result.json"
        cmd = [sys.executable, *args, out_flag, str(out)]
        try:
            proc = subprocess.run(cmd, timeout=timeout_s, stdout=subprocess.PIPE,
                                  stderr=None if show_stderr else subprocess.STDOUT, text=True)
        except subprocess.TimeoutExpired:
            return {"error": f"over the {timeout_s:.0f} s limit"}
        if proc.returncode != 0 or not out.exists():
            tail = proc.stdout.strip().splitlines()[-1:] if proc.stdout else []
            why = "killed (out of memory?)" if proc.returncode in (-9, 137) else f"exit code {proc.returncode}"
            return {"error": f"{why}: {' '.join(tail)[-400:]}"}
        return json.loads(out.read_text())


def parse_token_counts(text: str) -> list:
    """"1k,4k,20000" -> [1024, 4096, 20000] (a k suffix counts 1024)."""
    out = []
    for t in text.split(","):
        t = t.strip().lower()
        out.append(int(t[:-1]) * 1024 if t.endswith("k") else int(t))
    return out
