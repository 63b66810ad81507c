"""Training text every machine has: the Python standard library's own source files.

Byte-level tokens (vocabulary 256, no tokenizer to download). The corpus is the
sorted list of ``*.py`` files under ``sysconfig``'s stdlib path, concatenated
with a newline between files, so every machine with the same Python version
reads the same bytes. Batches are drawn at seeded random offsets.
"""
from __future__ import annotations

import sysconfig
from pathlib import Path

import torch

VOCAB = 256


def stdlib_corpus(max_bytes: int = 64 << 20) -> torch.Tensor:
    """The stdlib's ``*.py`` sources as one uint8 tensor (at most ``max_bytes``)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    if not files:
        raise RuntimeError(f"training data: no Python sources found under {root}")
    chunks, total = [], 0
    for path in files:
        try:
            data = path.read_bytes()
        except OSError:
            continue  # unreadable files are skipped; the listing order stays fixed
        chunks.append(data + b"\n")
        total += len(data) + 1
        if total >= max_bytes:
            break
    blob = b"".join(chunks)[:max_bytes]
    return torch.frombuffer(bytearray(blob), dtype=torch.uint8)


class Batches:
    """Seeded random windows of ``seq_len + 1`` bytes; ``state()`` / ``load()`` resume exactly."""

    def __init__(self, corpus: torch.Tensor, seq_len: int, batch: int, seed: int):
        if corpus.numel() <= seq_len + 1:
            raise ValueError(f"--seq-len: {seq_len} is longer than the corpus ({corpus.numel()} bytes)")
        self.corpus, self.seq_len, self.batch = corpus, seq_len, batch
        self.generator = torch.Generator().manual_seed(seed)

    def next(self) -> torch.Tensor:
        """``[batch, seq_len]`` int64 token ids (labels are the same ids: the model shifts them)."""
        starts = torch.randint(0, self.corpus.numel() - self.seq_len, (self.batch,), generator=self.generator)
        rows = [self.corpus[s: s + self.seq_len] for s in starts.tolist()]
        return torch.stack(rows).long()

    def state(self) -> torch.Tensor:
        return self.generator.get_state()

    def load(self, state: torch.Tensor) -> None:
        self.generator.set_state(state)
