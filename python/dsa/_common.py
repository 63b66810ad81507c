"""Checks shared by every op wrapper (the C++ core validates everything else)."""
from __future__ import annotations

import torch
import torch.utils.dlpack

LAYOUTS = ("TND", "BSND")
BACKENDS = ("auto", "reference", "cpu", "cuda")


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"layout: expected 'TND' or 'BSND', got {layout!r}")
    return layout


def check_backend(backend: str) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend: expected one of {', '.join(map(repr, BACKENDS))}, got {backend!r}")
    return backend


def handoff(*tensors):
    """The tensors as DLPack capsules for a ``_C`` call (None stays None): nanobind takes
    a capsule as it is, where for a tensor it calls ``Tensor.__dlpack__``, a Python method
    (~6 us a tensor against ~1 us for ``to_dlpack``, Zen 1 class EPYC: 44 of a decode
    attention call's ~80 us in ``_C``, with up to 12 tensor arguments). For the
    per-token ops.
    What ``__dlpack__`` refuses besides is nothing ``_C`` takes: a tensor that requires
    grad (the kernels read data only) or one with the conjugate or negative bit (complex
    views; ``_C`` refuses complex dtypes by name)."""
    return tuple(None if t is None else torch.utils.dlpack.to_dlpack(t) for t in tensors)


def check_tensor(value, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(value).__name__}")
    return value


def check_tensors(required: dict, optional: dict | None = None) -> None:
    """Every ``required`` value is a tensor, every ``optional`` one is None or a tensor,
    and all of them are on one device. A meta tensor (a shape without data: a weight
    not loaded yet, say) beside real ones is named: torch would hand the op's fake
    kernel the call, whose outputs hold no result. All-meta calls stay allowed (shape
    propagation runs the fake kernels)."""
    named = []
    for name, value in required.items():
        named.append((name, check_tensor(value, name)))
    for name, value in (optional or {}).items():
        if value is not None:
            named.append((name, check_tensor(value, name)))
    if not named:
        return
    # is_meta / is_cpu, not device.type: building a device object costs ~1 us a tensor,
    # which a decode call (up to 10 tensors, several calls a layer per token) pays.
    real = [(n, t) for n, t in named if not t.is_meta]
    if real and len(real) < len(named):
        meta = next(n for n, t in named if t.is_meta)
        raise ValueError(f"{meta}: a meta tensor (a shape without data, e.g. a weight not loaded yet) beside "
                         f"{real[0][0]} on {real[0][1].device}; materialise it first (module.to_empty(device=...) "
                         "and load_state_dict, or from_pretrained without an empty-weights context)")
    if all(t.is_cpu for _, t in real):
        return
    for name, t in real[1:]:
        if t.device != real[0][1].device:
            raise ValueError(f"{name}: on {t.device}, but {real[0][0]} is on {real[0][1].device}; "
                             "every tensor of one call goes on one device")


def check_int(value, name: str, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}: expected an integer, got {value!r}")
    if value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value}")
    return value


def num_threads() -> int:
    """Threads for a kernel call: the torch layer follows torch's own setting."""
    return torch.get_num_threads()


# The tensor types an eager call takes as they are (plain_eager).
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def plain_eager(*tensors) -> bool:
    """Whether an op call may bypass its torch.library custom op and run as a plain
    torch.autograd.Function: eager (not traced by torch.compile / export), no
    TorchDispatchMode or TorchFunctionMode (FakeTensorMode, FlopCounterMode, ...)
    and no functorch transform active, and only plain CPU tensors (None allowed).
    Everything else goes through the custom op and its fake kernel.
    A module's ``nn.Parameter`` (a model's sinks, a compressor's position_bias) is a
    plain tensor here: without that, every such call in a model went through the
    custom op (a DeepSeek-V4 decode step: ~300 us a compressor_append call instead of
    ~45, Zen 1 class EPYC). A parameter of a tensor subclass has the subclass's type."""
    if (torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack()
            or torch._C._len_torch_function_stack() or torch._C._are_functorch_transforms_active()):
        return False
    return all(t is None or (type(t) in _PLAIN and t.is_cpu) for t in tensors)


def named_for_profiler(name: str, kernel):
    """``kernel`` for an eager call that skips its torch.library op: while torch's
    profiler runs, the call is a range named as the op (``dsa::...``), as the
    dispatcher names the op's own calls, so a profile (and dsa-train's per-op time)
    finds it either way; otherwise the kernel as it is (the check: ~0.2 us)."""
    def run(*args):
        if not torch._C._autograd._profiler_enabled():
            return kernel(*args)
        with torch.profiler.record_function(name):
            return kernel(*args)
    run.__name__ = run.__qualname__ = getattr(kernel, "__name__", name)
    return run


def missing_extra(modules, extra: str, what: str):
    """None when every module in ``modules`` imports; else the one-line message a CLI
    prints before any work: which package is missing and the extra that brings it."""
    import importlib.util
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if not missing:
        return None
    return (f"{what} needs {', '.join(missing)}, not installed: pip install \"dsa[{extra}]\" "
            f"(or pip install {' '.join(missing)})")
