"""CUDA memory snapshots with the object layout of ``torch.cuda.memory._snapshot()``, for tests and
benchmarks on a machine without a GPU (``_record_memory_history`` needs one).

The dict is built the way torch's C++ side builds it (torch/csrc/cuda/Module.cpp, and
memory_snapshot.cpp for the C++ API), because the pickle's shape follows the objects' identity:

- key and action strings are one object each per snapshot (``py::str action_s = "action"``), so
  the pickle writes them once and refers to them through the memo afterwards;
- frames are symbolized once per unique frame (``py_symbolize``): one dict per frame, shared by
  every traceback that contains it, with its own ``name``/``filename`` strings;
- each allocation gathers its own traceback, so each trace entry has its own frames list, except
  that ``free_completed`` and a block still allocated at the end reuse the traceback of the
  allocation (``context_when_allocated``): the same list object, written once;
- dict insertion order as torch's: an entry's ``frames`` comes last (set after symbolizing), and
  the snapshot is ``segments``, ``device_traces``, ``allocator_settings``.

``_dump_snapshot`` writes it with ``pickle.dump`` (the default protocol: 4 on Python 3.8-3.13).
The allocation pattern is a training loop: parameters and optimizer state first, then per step
activations freed in reverse, gradients and temporaries, with sizes rounded as the caching
allocator rounds (512 bytes) and addresses reused.
"""

from __future__ import annotations

import random

TORCH_FRAMES = [("torch/nn/modules/module.py", "_call_impl"), ("torch/nn/functional.py", "linear"),
                ("torch/autograd/graph.py", "_engine_run_backward"), ("torch/optim/adamw.py", "_single_tensor_adamw"),
                ("torch/_tensor.py", "backward"), ("torch/nn/modules/linear.py", "forward")]
# C++ frames as an H100 recording (tests/gpu_fixtures) names them: line 0, a source file or '??' or ''
CPP_FRAMES = [("??", "torch::CapturedTraceback::gather(bool, bool, bool)"),
              ("memory_snapshot.cpp", "torch::cuda::(anonymous namespace)::gather_with_cpp()"),
              ("CUDACachingAllocator.cpp",
               "c10::cuda::CUDACachingAllocator::Native::DeviceCachingAllocator::malloc(unsigned long, CUstream_st*)"),
              ("", "c10::cuda::CUDACachingAllocator::Native::NativeCachingAllocator::allocate(unsigned long)"),
              ("RegisterCUDA_0.cpp", "at::(anonymous namespace)::(anonymous namespace)::wrapper_CUDA__empty_strided"),
              ("??", "at::_ops::empty_memory_format::call"),
              ("python_variable_methods.cpp", "torch::autograd::THPVariable_to_type(_object*, c10::ScalarType)")]
USER_SITES = [("train.py", "forward", "activation"), ("train.py", "backward_step", "gradient"),
              ("model.py", "attention", "activation"), ("model.py", "mlp", "activation"),
              ("optim.py", "step", "optimizer_state"), ("train.py", "loss_fn", "temporary")]
KEYS = ("action", "addr", "size", "stream", "time_us", "frames", "device", "address", "total_size",
        "allocated_size", "active_size", "requested_size", "segment_type", "segment_pool_id",
        "is_expandable", "blocks", "state", "name", "filename", "line")
POOL = 1500  # unique symbolized frames
SITES = 512  # distinct allocation call stacks
ACTIONS = ("alloc", "free_requested", "free_completed", "segment_alloc", "segment_free")


def cuda_snapshot(entries: int, depth: int = 40, seed: int = 0) -> tuple[dict, dict]:
    """(snapshot dict, truth) with about ``entries`` trace entries on device 0. ``truth`` holds what
    an analysis must find: the peak allocated bytes and its entry index, the bytes allocated when
    the trace began (``baseline``), of those the bytes still allocated at its end (``pre_live``),
    and the bytes allocated at the end."""
    rng = random.Random(seed)
    k = {name: "".join(name) for name in KEYS}  # one str object per key, as torch's py::str locals
    act = {a: "".join(a) for a in ACTIONS}
    frames_by_site: dict[tuple, list[dict]] = {}

    def frame(filename: str, name: str, line: int) -> dict:
        return {k["name"]: "".join(name), k["filename"]: "".join(filename), k["line"]: line}

    # symbolized frames: torch's Python frames and C++ frames (stacks="all"), one dict each
    pool = [frame(f"/usr/lib/python3/site-packages/{f}", n, rng.randrange(1, 4000)) if f.endswith(".py")
            else frame(f, n, 0)
            for _ in range(POOL // len(TORCH_FRAMES + CPP_FRAMES))
            for f, n in TORCH_FRAMES + CPP_FRAMES]

    def traceback(site: int) -> list[dict]:
        # innermost first, as torch writes them: allocator and torch frames, then the user's frame
        if site not in frames_by_site:
            f, n, _ = USER_SITES[site % len(USER_SITES)]
            user = frame(f"/home/me/project/{f}", n, 10 + site)
            frames_by_site[site] = [rng.choice(pool) for _ in range(depth - 1)] + [user]
        return list(frames_by_site[site])  # a new list object per gathered traceback

    trace: list[dict] = []
    t = [1_716_000_000_000_000]

    def entry(action: str, addr: int, size: int, frames: list) -> None:
        t[0] += rng.randrange(1, 50)
        trace.append({k["action"]: act[action], k["addr"]: addr, k["size"]: size, k["stream"]: 0,
                      k["time_us"]: t[0], k["frames"]: frames})

    base, free_addrs, live = 0x7F3A_0000_0000, [], {}
    next_addr = [base]

    def alloc(size: int, site: int) -> int:
        addr = free_addrs.pop() if free_addrs and rng.random() < 0.7 else None
        if addr is None:
            addr, next_addr[0] = next_addr[0], next_addr[0] + (1 << 22)
        frames = traceback(site)
        entry("alloc", addr, size, frames)
        live[addr] = (size, frames)
        return addr

    def free(addr: int) -> None:
        size, frames = live.pop(addr)
        entry("free_requested", addr, size, traceback(SITES + rng.randrange(64)))
        entry("free_completed", addr, size, frames)  # the allocation's own traceback object
        free_addrs.append(addr)

    # before the trace: state allocated earlier (in segments only), one buffer freed inside the trace
    pre = {base - (1 << 30) + i * (1 << 24): (rng.randrange(1, 64) * (1 << 20), traceback(4))
           for i in range(8)}
    freed_pre = next(iter(pre))
    cur = peak = baseline = sum(s for s, _ in pre.values())
    peak_at = -1  # before the first entry
    entry("free_requested", freed_pre, pre[freed_pre][0], traceback(SITES))
    entry("free_completed", freed_pre, pre[freed_pre][0], pre[freed_pre][1])
    cur -= pre.pop(freed_pre)[0]
    while len(trace) < entries:
        stack = []
        for layer in range(rng.randrange(4, 40)):  # forward: activations
            size = (rng.randrange(1, 1 << 14) + 1) * 512
            stack.append(alloc(size, rng.randrange(SITES)))
            cur += size
            if cur > peak:
                peak, peak_at = cur, len(trace) - 1
        while stack:  # backward: activations freed, a gradient temporary each
            g = (rng.randrange(1, 1 << 12) + 1) * 512
            ga = alloc(g, rng.randrange(SITES))
            cur += g
            if cur > peak:
                peak, peak_at = cur, len(trace) - 1
            free(ga)
            cur -= g
            a = stack.pop()
            cur -= live[a][0]
            free(a)
    for layer in range(6):  # the trace ends inside a forward: these stay allocated
        size = (rng.randrange(1, 1 << 14) + 1) * 512
        alloc(size, rng.randrange(SITES))
        cur += size
        if cur > peak:
            peak, peak_at = cur, len(trace) - 1
    segments, empty_frames = [], []
    for addr, (size, frames) in sorted({**{a: v for a, v in pre.items()}, **live}.items()):
        block = {k["address"]: addr, k["size"]: size, k["requested_size"]: size,
                 k["state"]: "active_allocated", k["frames"]: frames}
        segments.append({k["device"]: 0, k["address"]: addr, k["total_size"]: size, k["allocated_size"]: size,
                         k["active_size"]: size, k["requested_size"]: size, k["stream"]: 0,
                         k["segment_type"]: "large", k["segment_pool_id"]: (0, 0), k["is_expandable"]: False,
                         k["blocks"]: [block], k["frames"]: empty_frames})
    snap = {"segments": segments, "device_traces": [trace],
            "allocator_settings": {"PYTORCH_CUDA_ALLOC_CONF": "", "max_split_size": -1}}
    truth = {"peak": peak, "peak_at": peak_at, "entries": len(trace), "baseline": baseline,
             "pre_live": sum(s for s, _ in pre.values()), "live_at_end": cur}
    return snap, truth
