"""The machine a benchmark ran on, and its ceilings measured in the same run.

Ceilings are what plain PyTorch reaches on this machine with the same thread
count: bf16 and fp32 GEMM through ``torch.matmul`` on large squares (oneDNN, AMX
where present) and the copy bandwidth of a large ``Tensor.copy_`` (bytes read +
written). A case reports its throughput as a fraction of one of them.
"""
from __future__ import annotations

import os
import platform
import subprocess
import time

import torch


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return platform.processor() or "unknown CPU"


def last_level_cache_bytes() -> int:
    """Size of the largest CPU cache sysfs reports for CPU 0 (0 when unknown)."""
    base = "/sys/devices/system/cpu/cpu0/cache"
    best = 0
    try:
        names = os.listdir(base)
    except OSError:
        return 0
    for name in names:
        try:
            with open(os.path.join(base, name, "size")) as f:
                text = f.read().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:].upper(), 1)
        digits = text[:-1] if scale != 1 else text
        if digits.isdigit():
            best = max(best, int(digits) * scale)
    return best


def cache_flush_bytes() -> int:
    """Bytes the harness writes before each timed run to evict the previous run's
    data: the last-level cache's size, at least 256 MiB (on this VM copies slow to
    memory speed from 128 MiB, so its share of the 480 MiB L3 is smaller still)."""
    return max(256 << 20, last_level_cache_bytes())


def machine_info(threads: int) -> dict:
    from .. import _C
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    return {
        "cpu": cpu_model(),
        "logical_cpus": os.cpu_count(),
        "threads": threads,
        "isa": _C.cpu_isa(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "load_avg_1min_at_start": round(load, 2),
        "cache_flush_mib": cache_flush_bytes() >> 20,
    }


def _best_seconds(fn, reps: int) -> float:
    fn()  # warm-up: oneDNN primitive creation, page faults
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def gemm_flops(dtype: torch.dtype, n: int = 4096, reps: int = 3) -> float:
    """Best-of-``reps`` FLOP/s of an n x n x n ``torch.matmul`` in ``dtype``."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(dtype)
    b = torch.randn(n, n, generator=g).to(dtype)
    c = torch.empty(n, n, dtype=dtype)
    sec = _best_seconds(lambda: torch.matmul(a, b, out=c), reps)
    return 2.0 * n * n * n / sec


def copy_bandwidth(mib: int = 256, reps: int = 5) -> float:
    """Best-of-``reps`` bytes/s of ``dst.copy_(src)``, counting bytes read plus written."""
    n = mib * (1 << 20) // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.zeros(n, dtype=torch.float32)
    sec = _best_seconds(lambda: dst.copy_(src), reps)
    return 2.0 * src.numel() * src.element_size() / sec


def measure_ceilings(gemm_size: int = 4096, copy_mib: int = 256) -> dict:
    """{"bf16_gemm": FLOP/s, "fp32_gemm": FLOP/s, "copy_bw": bytes/s}."""
    return {
        "bf16_gemm": gemm_flops(torch.bfloat16, gemm_size, reps=5),
        "fp32_gemm": gemm_flops(torch.float32, gemm_size),
        "copy_bw": copy_bandwidth(copy_mib),
    }
