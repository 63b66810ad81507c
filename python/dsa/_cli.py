"""Argument helpers the command-line tools share (dsa-train, dsa-generate)."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

# The model dtypes the tools take, by their short names; torch's names are
# accepted too, as transformers' arguments spell them.
DTYPE_NAMES = ("fp32", "bf16")
_DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16"}


def dtype_arg(text: str) -> str:
    """argparse type of --dtype: fp32 / float32 or bf16 / bfloat16, as the short name."""
    name = _DTYPE_ALIASES.get(text, text)
    if name not in DTYPE_NAMES:
        raise argparse.ArgumentTypeError(f"--dtype: expected fp32 / float32 or bf16 / bfloat16, got {text!r}")
    return name


def check_writable(path: str, what: str, folder: bool = False) -> None:
    """Fails before any work starts when `path` cannot be written: a file (or, with
    `folder`, a folder to create) is tried for real, by creating its missing parent
    folders and opening a file there, since os.access says yes to root everywhere
    (/proc/nope/x.json passes it). A file this creates is removed again."""
    p = Path(path).absolute()
    where = p if folder else p.parent
    try:
        if not folder and p.is_dir():
            raise IsADirectoryError(f"{p} is a folder")
        if where.exists() and not where.is_dir():
            raise NotADirectoryError(f"{where} is a file, not a folder")
        where.mkdir(parents=True, exist_ok=True)
        probe = where / f".dsa-write-check-{os.getpid()}" if folder else p
        existed = probe.exists()
        with open(probe, "a"):
            pass
        if not existed:
            # missing_ok: another process checking the same path (a torchrun rank) may
            # have removed the empty file first; that is no failure to write.
            probe.unlink(missing_ok=True)
    except OSError as e:
        raise ValueError(f"{what}: cannot write {path!r} ({e.strerror or e})") from None
