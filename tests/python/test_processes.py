"""dsa ops from several Python threads, in fork and spawn children, and across
torch.set_num_threads changes -- on either thread runtime (dsa's own pool or
PyTorch's OpenMP team, see test_threads.py). Anything that could hang runs in a
child process or with a timeout, so a hang fails the test instead of blocking CI.
"""
from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import dsa
from dsa import _C

RUNTIMES = ["own", "openmp"]
TIMEOUT_S = 60


def workload(seed: int = 0):
    """A call of each op family, forward and backward; returns every output tensor.
    Small, but with enough tasks for every thread to get work."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(300, 4, 64, generator=g).bfloat16()
    k = torch.randn(300, 64, generator=g).bfloat16()
    w = torch.randn(300, 4, generator=g)
    indices = dsa.dsa_indexer(q, k, w, topk=32, query_lengths=[100, 300], key_lengths=[100, 300])
    query = torch.randn(300, 4, 64, generator=g).bfloat16().requires_grad_()
    kv = torch.randn(300, 64, generator=g).bfloat16().requires_grad_()
    out, mx, sm = dsa.dsa_sparse_attention(query, kv, indices, scale=0.125, query_lengths=[100, 300],
                                           key_lengths=[100, 300])
    d_query, d_kv = torch.autograd.grad(out.float().square().sum(), (query, kv))
    ckv = torch.randn(600, 128, generator=g).bfloat16().requires_grad_()
    gate = torch.randn(600, 128, generator=g).bfloat16().requires_grad_()
    bias = torch.randn(4, 128, generator=g).requires_grad_()
    compressed, _ = dsa.dsa_compressor(ckv, gate, bias, ratio=4, query_lengths=[250, 600])
    grads = torch.autograd.grad(compressed.float().square().sum(), (ckv, gate, bias))
    return (indices, out, mx, sm, d_query, d_kv, compressed) + grads


def assert_same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def _use_runtime(name: str) -> None:
    _C.use_openmp_threads(name == "openmp")


def _restore_runtime() -> None:
    _C.use_openmp_threads(bool(dsa.THREAD_RUNTIME))


def _run_child(code: str, runtime: str) -> subprocess.Popen:
    env = dict(os.environ, DSA_THREAD_POOL=runtime)
    env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)  # dsa and this directory, as here
    return subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen) -> str:
    try:
        out, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        pytest.fail(f"child hung (killed after {TIMEOUT_S} s):\n{out}")
    assert proc.returncode == 0, out
    return out


# Runs in a fresh process per runtime: three Python threads call the ops at once
# and must get the serial bits; then torch.set_num_threads changes
# between calls must reach dsa (its own pool grows to num_threads - 1 workers).
CONCURRENT = """
    import os, threading, torch, dsa
    from concurrent.futures import ThreadPoolExecutor
    from test_processes import assert_same, workload
    assert (dsa.THREAD_RUNTIME == "") == (os.environ["DSA_THREAD_POOL"] == "own"), dsa.THREAD_RUNTIME
    torch.set_num_threads(2)
    serial = [workload(seed) for seed in range(3)]
    with ThreadPoolExecutor(3) as pool:
        futures = [pool.submit(workload, seed) for seed in range(3)]
        for seed, f in enumerate(futures):
            assert_same(f.result(timeout=60), serial[seed])
    if not dsa.THREAD_RUNTIME:
        def threads():
            return set(os.listdir("/proc/self/task"))
        first = workload(0)
        workers = 1  # the pool's, from the 2-thread calls above
        for n in (1, 3, 2, 5, 1):
            torch.set_num_threads(n)
            torch.randn(1 << 20).exp().sum()  # torch's own team grows to n here, not in the count below
            before = threads()
            assert_same(workload(0), first)
            # dsa's pool keeps its workers and grows exactly when a call asks for more. Counted
            # as threads that appeared: one of torch's OpenMP threads may exit meanwhile after its
            # team shrank (a fresh-clone CI run saw a net -1 at n = 2).
            started = len(threads() - before)
            assert started == max(0, n - 1 - workers), (n, workers, started)
            workers = max(workers, n - 1)
    print("OK")
"""


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_concurrent_threads_and_thread_count_changes(runtime):
    assert "OK" in _finish(_run_child(CONCURRENT, runtime))


def fork_inputs(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return dict(q=torch.randn(300, 4, 64, generator=g).bfloat16(), k=torch.randn(300, 64, generator=g).bfloat16(),
                w=torch.randn(300, 4, generator=g), query=torch.randn(300, 4, 64, generator=g).bfloat16(),
                kv=torch.randn(300, 64, generator=g).bfloat16(),
                grad_out=torch.randn(300, 4, 64, generator=g).bfloat16(), lengths=torch.tensor([100, 300]))


def dsa_only(x: dict):
    """The indexer and the attention forward and backward, with no parallel torch op
    around them: in a fork child torch's own OpenMP regions hang (libgomp's team
    stays in the parent), so only dsa's threads are under test there."""
    lengths = x["lengths"]
    idx = dsa.dsa_indexer(x["q"], x["k"], x["w"], topk=32, query_lengths=lengths, key_lengths=lengths)
    op_args = (x["query"], x["kv"], idx, None, None, None, None, None, lengths, lengths, 0.125, 0, 0, 1, "TND",
               "cpu")
    out, mx, sm = torch.ops.dsa.sparse_attention_fwd(*op_args)
    grads = torch.ops.dsa.sparse_attention_bwd(x["grad_out"], out, mx, sm, *op_args)
    return (idx, out, mx, sm, grads[0], grads[1])


def _raw_bytes(tensors) -> list:
    """The bits of each tensor through numpy, which runs no OpenMP region."""
    ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}
    return [t.view(ints[t.element_size()]).numpy().tobytes() for t in tensors]


def _result_of(child, queue, what: str):
    """The child's one message (read before joining: a large message blocks the
    child's exit until it is read), or a failure if it hangs or dies."""
    try:
        result = queue.get(timeout=TIMEOUT_S)
    except Exception:  # queue.Empty: no answer in time
        child.kill()
        child.join()
        pytest.fail(f"{what} hung or died (exit code {child.exitcode})")
    child.join(TIMEOUT_S)
    assert child.exitcode == 0, what
    return result


def _fork_child(queue, inputs, threads):
    torch.set_num_threads(threads)
    # The child's fresh workspace cache (see src/core/memory.cpp) keeps the parent's limit.
    queue.put((_raw_bytes(dsa_only(inputs)), _C.workspace_cache_limit()))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_fork_child_after_parent_ran_ops(runtime, threads):
    """fork() copies only the calling thread: the parent's pool workers or OpenMP
    team do not exist in the child. A region there used to wait for them forever."""
    _use_runtime(runtime)
    cache_limit = _C.workspace_cache_limit()
    try:
        _C.set_workspace_cache_limit(123 << 20)
        torch.set_num_threads(2)
        inputs = fork_inputs()
        expected = dsa_only(inputs)  # the parent's threads are up
        ctx = multiprocessing.get_context("fork")
        queue = ctx.Queue()
        child = ctx.Process(target=_fork_child, args=(queue, inputs, threads))
        child.start()
        got, child_cache_limit = _result_of(child, queue, f"fork child ({runtime}, {threads} threads)")
        assert got == _raw_bytes(expected)
        assert child_cache_limit == 123 << 20
        assert_same(dsa_only(inputs), expected)  # and the parent still works
    finally:
        _C.set_workspace_cache_limit(cache_limit)
        torch.set_num_threads(2)
        _restore_runtime()


class _OpDataset(torch.utils.data.Dataset):
    def __len__(self):
        return 4

    def __getitem__(self, i):
        return workload(i)[0]  # the indexer's selection


@pytest.mark.parametrize("runtime", RUNTIMES)
def test_dataloader_fork_workers(runtime):
    _use_runtime(runtime)
    try:
        expected = [workload(i)[0] for i in range(4)]
        loader = torch.utils.data.DataLoader(_OpDataset(), batch_size=None, num_workers=2,
                                             multiprocessing_context="fork", timeout=TIMEOUT_S)
        got = list(loader)  # DataLoader's timeout raises if a worker hangs
        assert_same(got, expected)
    finally:
        _restore_runtime()


def _spawn_child(queue, expected):
    queue.put(all(torch.equal(a, b) for a, b in zip(workload(0), expected)))


def test_spawn_child():
    expected = [t.detach() for t in workload(0)]
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    child = ctx.Process(target=_spawn_child, args=(queue, expected))
    child.start()
    assert _result_of(child, queue, "spawn child")
