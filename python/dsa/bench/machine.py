"""The machine a benchmark ran on, and its ceilings measured in the same run.

Ceilings, all on the thread count the cases use:

* dsa's own arithmetic peaks (``_C.measure_peak_flops``): register-only loops of
  SSE mul + add, AVX2 FMA, AVX-512 FMA and AVX-512 ``vdpbf16ps``, each that the
  CPU has. They are the ceiling of an ISA even where dsa runs below the CPU's
  best (``DSA_ISA=avx2`` on an AVX-512 machine, where torch's GEMM would still
  use AVX-512).
* torch's fp32 GEMM, and its bf16 GEMM only where torch has a native bf16 path
  (``probe_bf16``: on AVX2-only CPUs torch emulates bf16 at ~1 GFLOP/s, and a
  4096^2 GEMM would take minutes).
* the copy bandwidth of a large ``Tensor.copy_`` (bytes read + written).
* the vector issue rate of the ISA dsa runs (``vector_op_rate``): its fp32 FMA
  peak in vector instructions per second, the bound of ops that are neither a
  product nor a stream (the compressor), for their count of vector operations.

``choose_ceiling`` picks the one a case is compared with. Every measurement is
bounded in wall time.
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
        "torch_isa": torch_isa_info(),
        "python": platform.python_version(),
        "load_avg_1min_at_start": round(load, 2),
        "cache_flush_mib": cache_flush_bytes() >> 20,
    }



# torch held to the ISA dsa runs, for DSA_ISA runs that stand for a smaller CPU
# (``DSA_ISA=avx2`` on an AVX-512 machine measures what a Zen 3 user sees): ATen's
# kernels, oneDNN (torch's bf16 matmul) and MKL (its fp32 GEMM) each read their own
# variable once, at their first use, so the whole process must start with them.
# On an AVX2-only CPU oneDNN has no bf16 path and torch's bf16 matmul is an
# emulation (~1 GFLOP/s); so it is here with these set (measured on Zen 5).
TORCH_ISA_ENV = {
    "portable": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41", "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"},
    "avx2": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
    "avx512": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE",
               "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "avx512_bf16": {"ATEN_CPU_CAPABILITY": "avx512", "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16",
                    "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "amx": {},
}


def torch_isa_env(isa: str) -> dict:
    """The environment that holds torch to dsa's ISA ``isa`` (see TORCH_ISA_ENV)."""
    if isa not in TORCH_ISA_ENV:
        raise ValueError(f"isa: expected one of {', '.join(TORCH_ISA_ENV)}, got {isa!r}")
    return dict(TORCH_ISA_ENV[isa])


def torch_isa_info() -> dict:
    """What torch runs at in this process: ATen's capability and the variables set."""
    return {"aten": torch.backends.cpu.get_cpu_capability(),
            "env": {k: os.environ[k] for k in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")
                    if k in os.environ}}


# What the table calls each ceiling.
CEILING_LABEL = {
    "bf16_gemm": "bf16 GEMM (torch)",
    "fp32_gemm": "fp32 GEMM (torch)",
    "copy_bw": "copy BW",
    "fp32_portable": "fp32 mul+add portable",
    "fp32_fma_avx2": "fp32 FMA avx2",
    "fp32_fma_avx512": "fp32 FMA avx512",
    "bf16_dot_avx512": "bf16 dot avx512",
    "vector_ops": "vector ops at the FMA rate",
}

# The fp32 peak of each ISA dsa can run (AMX adds no fp32 instructions).
_FP32_PEAK_OF_ISA = {"amx": "fp32_fma_avx512", "avx512_bf16": "fp32_fma_avx512", "avx512": "fp32_fma_avx512",
                     "avx2": "fp32_fma_avx2", "portable": "fp32_portable"}

# fp32 lanes of one vector at each ISA dsa can run (no vector-op bound for portable:
# its scalar loops have no fixed width).
LANES_OF_ISA = {"amx": 16, "avx512_bf16": 16, "avx512": 16, "avx2": 8}


def vector_op_rate(ceilings: dict, isa: str) -> float:
    """Vector instructions per second at ``isa``: its measured fp32 FMA peak over the
    FLOPs of one vector FMA (2 x lanes), the measured peak rate of vector work. An op
    that needs N vector operations is timed at N / rate. Not a hard floor: a core
    whose add or shuffle pipes run beside its FMA pipes can retire a mix faster (on
    Zen 5 each operation of the compressor's mix cost about one FMA slot, and on
    Zen 1 the kernels reach 50-60 % of it). 0.0 where the ISA has no such rate."""
    lanes = LANES_OF_ISA.get(isa)
    peak = ceilings.get(_FP32_PEAK_OF_ISA.get(isa, ""))
    return peak / (2.0 * lanes) if lanes and peak else 0.0


# torch's bf16 matmul counts as native when it reaches at least this fraction of
# its fp32 rate on the probe's squares (native paths run 2-8x faster than fp32;
# the emulation on AVX2-only CPUs ~100x slower).
BF16_NATIVE_MIN_RATIO = 0.5


def choose_ceiling(work: str, dtype: str, isa: str, bf16_native: bool, peaks) -> str:
    """The ceiling key a case is compared with.

    work: "compute" or "copy_bw"; dtype: "bf16" or "fp32" (the case's inputs);
    isa: the ISA dsa runs (``_C.cpu_isa()``, after DSA_ISA); bf16_native: torch's
    bf16 GEMM is native here; peaks: the peak kernels this CPU has.

    * memory-bound cases: the copy bandwidth;
    * instruction-bound cases ("vector_ops"): the ISA's vector issue rate;
    * bf16 on AMX with a native torch bf16 GEMM: that GEMM (oneDNN's AMX path is
      what a bf16 matmul reaches there);
    * bf16 at dsa's ``avx512_bf16`` level (Zen 4/5, or AMX without native torch
      bf16): the ``vdpbf16ps`` peak, the arithmetic dsa's bf16 kernels run there;
    * otherwise (fp32, or bf16 converted to fp32, as dsa's ``avx512`` and ``avx2``
      levels do): the fp32 FMA peak of the ISA.
    """
    if work in ("copy_bw", "vector_ops"):
        return work
    if work != "compute":
        raise ValueError(f"work: expected 'compute', 'copy_bw' or 'vector_ops', got {work!r}")
    if isa not in _FP32_PEAK_OF_ISA:
        raise ValueError(f"isa: expected one of {', '.join(_FP32_PEAK_OF_ISA)}, got {isa!r}")
    if dtype == "bf16":
        if isa == "amx" and bf16_native:
            return "bf16_gemm"
        if isa in ("amx", "avx512_bf16") and "bf16_dot_avx512" in peaks:
            return "bf16_dot_avx512"
    return _FP32_PEAK_OF_ISA[isa]


def binding_case(case, ceilings: dict, isa: str, bf16_native: bool, peaks):
    """A case whose ceiling is "binding" (decode: FLOPs or bytes; the compressor: bytes
    or vector operations; whichever bounds it on this machine): the same case compared
    with the slowest of its bounds - the compute ceiling for its FLOPs, the copy
    bandwidth for its bytes, the ISA's vector issue rate for its vector operations -
    each named with its time in the case's note."""
    from dataclasses import replace
    compute = ceilings.get(choose_ceiling("compute", case.dtype, isa, bf16_native, peaks))
    copy = ceilings.get("copy_bw")
    # The rate measure_ceilings stored for this machine's ISA, which the runner then
    # divides by too: one number for the bound's choice and the case's fraction.
    rate = ceilings.get("vector_ops", 0.0)
    ops = case.vector_ops.get(isa, 0.0)
    bounds = {}  # work -> (seconds, what binds, how its time was formed)
    if case.flops:
        bounds["compute"] = (case.flops / compute if compute else 0.0, "FLOPs", "at the compute ceiling")
    if case.bytes_moved:
        bounds["copy_bw"] = (case.bytes_moved / copy if copy else 0.0, "bytes moved", "at copy bandwidth")
    if ops and rate:
        bounds["vector_ops"] = (ops / rate, "vector operations",
                                f"for {ops / 1e6:.4g} M {isa} vector operations at {rate / 1e9:.3g} G/s")
    if not bounds:
        raise ValueError(f"{case.name}: a binding case needs flops, bytes_moved or vector_ops for {isa}")
    work = max(bounds, key=lambda k: bounds[k][0])
    why = (f"binding bound here: {bounds[work][1]} ("
           + ", ".join(f"{t * 1e3:.3g} ms {where}" for t, _, where in bounds.values()) + ")")
    return replace(case, ceiling=work, note=f"{case.note}; {why}" if case.note else why)


def ceiling_label(key: str, isa: str) -> str:
    if key == "bf16_gemm" and isa == "amx":
        return "bf16 GEMM (AMX)"
    if key == "vector_ops":
        return f"{isa} vector ops at the FMA rate"
    return CEILING_LABEL.get(key, key)


def _run_bounded(fn, max_reps: int, budget_s: float) -> tuple[float, int]:
    """Best seconds of up to ``max_reps`` timed calls after one warm-up, stopping
    once ``budget_s`` is spent (at least one timed call)."""
    fn()  # warm-up: oneDNN primitive creation, page faults
    best, reps = float("inf"), 0
    start = time.perf_counter()
    while reps < max_reps:
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        reps += 1
        if time.perf_counter() - start > budget_s:
            break
    return best, reps


def _gemm_inputs(dtype: torch.dtype, n: int):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=g).to(dtype)
    b = torch.randn(n, n, generator=g).to(dtype)
    return a, b, torch.empty(n, n, dtype=dtype)


def _gemm_rate(dtype: torch.dtype, n: int, max_reps: int, budget_s: float) -> float:
    a, b, c = _gemm_inputs(dtype, n)
    sec, _ = _run_bounded(lambda: torch.matmul(a, b, out=c), max_reps, budget_s)
    return 2.0 * n ** 3 / sec


def probe_bf16(n: int = 512, budget_s: float = 1.0) -> dict:
    """Whether torch's bf16 matmul is native here: bf16 vs fp32 FLOP/s on n^3.

    A few 128^3 bf16 matmuls first (~15 ms each even where bf16 is emulated at
    ~0.3 GFLOP/s) predict the n^3 one; if that would not fit ``budget_s`` bf16 is emulated
    without running it. Returns {"native", "bf16_flops", "fp32_flops", "n"}.
    """
    # One thread: whether the path is native does not depend on the thread count,
    # and on a loaded machine a multi-threaded call of a millisecond waits for
    # preempted team threads (measured: 25x slower at load 8 on 2 cores), a
    # single-threaded one only for its own core.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _probe_bf16(n, budget_s)
    finally:
        torch.set_num_threads(threads)


def _probe_bf16(n: int, budget_s: float) -> dict:
    fp32 = _gemm_rate(torch.float32, n, 3, budget_s / 4)
    a, b, c = _gemm_inputs(torch.bfloat16, 128)
    # The first call creates (JITs) oneDNN's primitive: ~10 ms, not the rate. Then
    # the best of a few calls: on a loaded machine one call can lose a whole time
    # slice (~10 ms) and would read as emulated. Emulated, each call is ~15 ms.
    small_s, _ = _run_bounded(lambda: torch.matmul(a, b, out=c), 5, budget_s / 10)
    small = 2.0 * 128 ** 3 / max(small_s, 1e-9)
    if 2.0 * n ** 3 / small * 2 > budget_s:  # warm-up + one timed call would not fit
        bf16, size = small, 128
    else:
        bf16, size = _gemm_rate(torch.bfloat16, n, 3, budget_s / 4), n
    return {"native": bf16 >= BF16_NATIVE_MIN_RATIO * fp32, "bf16_flops": bf16, "fp32_flops": fp32,
            "n": n, "bf16_n": size}


def gemm_flops(dtype: torch.dtype, n: int = 4096, reps: int = 3, rate_hint: float = 0.0,
               max_call_s: float = 1.5, budget_s: float = 4.0) -> tuple[float, int]:
    """Best FLOP/s of an n x n x n ``torch.matmul`` in ``dtype`` and the n used.

    ``rate_hint`` (FLOP/s from a smaller GEMM) halves n until one call is
    predicted to take at most ``max_call_s``; repeats stop once ``budget_s``
    is spent. Bounded: a slow machine measures a smaller square, never for minutes.
    """
    if rate_hint > 0:
        while n > 512 and 2.0 * n ** 3 / rate_hint > max_call_s:
            n //= 2
    return _gemm_rate(dtype, n, reps, budget_s), n


def copy_bandwidth(mib: int = 256, reps: int = 5) -> float:
    """Best-of-``reps`` bytes/s of ``dst.copy_(src)``, counting bytes read plus written."""
    n = mib * (1 << 20) // 4
    src = torch.ones(n, dtype=torch.float32)
    dst = torch.zeros(n, dtype=torch.float32)
    sec, _ = _run_bounded(lambda: dst.copy_(src), reps, 2.0)
    return 2.0 * src.numel() * src.element_size() / sec


def peak_flops(threads: int, seconds: float = 0.2) -> dict:
    """dsa's arithmetic peak of every kernel this CPU has, FLOP/s: {"fp32_fma_avx2": ..., ...}."""
    from .. import _C
    return {k: _C.measure_peak_flops(k, threads, seconds) for k in _C.peak_kernels()}


def measure_ceilings(threads: int, bf16: dict, gemm_size: int = 4096, copy_mib: int = 256) -> tuple[dict, dict]:
    """(ceilings, info). ceilings: FLOP/s or bytes/s by key (``CEILING_LABEL``);
    "bf16_gemm" only where ``bf16["native"]`` (the probe_bf16 result). info:
    the GEMM sizes used."""
    ceilings = peak_flops(threads)
    # The probe ran on one thread: all threads at perfect scaling is the optimistic
    # hint (a call may then take up to `threads` times longer than predicted, at worst).
    ceilings["fp32_gemm"], n32 = gemm_flops(torch.float32, gemm_size, rate_hint=bf16["fp32_flops"] * threads)
    info = {"fp32_gemm_n": n32}
    if bf16["native"]:
        ceilings["bf16_gemm"], n16 = gemm_flops(torch.bfloat16, gemm_size, reps=5,
                                                rate_hint=bf16["bf16_flops"] * threads)
        info["bf16_gemm_n"] = n16
    ceilings["copy_bw"] = copy_bandwidth(copy_mib)
    from .. import _C
    if rate := vector_op_rate(ceilings, _C.cpu_isa()):
        ceilings["vector_ops"] = rate
    return ceilings, info
