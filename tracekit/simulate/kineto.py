"""Per-rank Kineto (PyTorch profiler) Chrome traces, as a real NCCL GPU job records them
(FORMATS.md section 1): ``ProfilerStep#N`` spans; every collective as a ``record_param_comms``
cpu_op plus an NCCL kernel on its group's stream, both carrying the group's name, description,
ranks and sizes; p2p as ``send``/``recv`` over the whole pipeline group with no peer (the peer
is only implied by the schedule); compute as GPU kernels launched by ``cudaLaunchKernel``.

Two NCCL generations, chosen by the seed's parity: newer (``ncclDevKernel_*``, ``Seq`` args,
Hopper GEMMs) and older (``ncclKernel_*``, no ``Seq``, Ampere GEMMs). An op that was issued but
never completed (a hang) has its CPU-side record and launch but no kernel; an op never issued
has nothing.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np

from tracekit.simulate.clock import Clocks
from tracekit.simulate.model import Op
from tracekit.simulate.ranks import RankOps, Views

COLL_NAME = {"all_reduce": "allreduce", "all_gather": "_allgather_base", "reduce_scatter": "_reduce_scatter_base",
             "send": "send", "recv": "recv"}
# ProcessGroupNCCL's profiling titles (nccl: annotations, flight-recorder profiling_name)
PROFILING_NAME = {"all_reduce": "nccl:all_reduce", "all_gather": "nccl:_all_gather_base",
                  "reduce_scatter": "nccl:_reduce_scatter_base", "send": "nccl:send", "recv": "nccl:recv"}
# the aten op that launches each compute kernel (written with --detail)
ATEN = {"embedding": "aten::embedding", "attn_fwd": "aten::_flash_attention_forward",
        "attn_bwd": "aten::_flash_attention_backward", "mlp_fwd": "aten::mm", "mlp_bwd": "aten::mm",
        "head_fwd": "aten::mm", "head_bwd": "aten::mm", "loss": "aten::_log_softmax", "optimizer": "aten::_fused_adam_"}
_NEW_KERNEL = {"all_reduce": "AllReduce_Sum_{dt}_RING_LL", "all_gather": "AllGather_RING_LL",
               "reduce_scatter": "ReduceScatter_Sum_{dt}_RING_LL", "send": "SendRecv", "recv": "SendRecv"}
_OLD_KERNEL = {"all_reduce": "AllReduce_RING_LL_Sum_{dt}", "all_gather": "AllGather_RING_LL_Sum_int8_t",
               "reduce_scatter": "ReduceScatter_RING_LL_Sum_{dt}", "send": "SendRecv_RING_SIMPLE_Sum_int8_t",
               "recv": "SendRecv_RING_SIMPLE_Sum_int8_t"}
_DT = {True: {"BFloat16": "bf16", "Float": "f32"}, False: {"BFloat16": "bfloat16", "Float": "float"}}
_GEMM = {True: "sm90_xmma_gemm_bf16bf16_bf16f32_f32_{t}_n_tilesize128x256x64_warpgroupsize2x1x1_"
               "execute_segment_k_off_kernel__5x_cublas",
         False: "ampere_bf16_s16816gemm_bf16_256x128_ldg8_f2f_stages_64x3_{t}"}
_AT = "void at::native::(anonymous namespace)::"
KERNELS = {
    "embedding": _AT + "indexSelectLargeIndex<c10::BFloat16, long, unsigned int, 2, 2, -2, true>(at::cuda::detail::"
                       "TensorInfo<c10::BFloat16, unsigned int>, at::cuda::detail::TensorInfo<c10::BFloat16 const, "
                       "unsigned int>, at::cuda::detail::TensorInfo<long const, unsigned int>, int, int, unsigned int, "
                       "unsigned int, long)",
    "attn_fwd": "void flash_fwd_kernel<Flash_fwd_kernel_traits<128, 128, 64, 4, false, false, cutlass::bfloat16_t, "
                "Flash_kernel_traits<128, 128, 64, 4, cutlass::bfloat16_t> >, false, true, false, false, true, true, "
                "false, false>(flash::Flash_fwd_params)",
    "attn_bwd": "void flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128, 64, 128, 8, 2, 4, 2, "
                "false, false, cutlass::bfloat16_t, Flash_kernel_traits<128, 64, 128, 8, cutlass::bfloat16_t> >, true, "
                "false, false, false, false, true, false, false>(flash::Flash_bwd_params)",
    "loss": _AT + "cunn_SoftMaxForward<4, c10::BFloat16, float, c10::BFloat16, at::native::(anonymous namespace)::"
                  "LogSoftMaxForwardEpilogue>(c10::BFloat16*, c10::BFloat16 const*, int)",
    "optimizer": _AT + "multi_tensor_apply_kernel<at::native::(anonymous namespace)::TensorListMetadata<4>, "
                       "at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4, (at::native::ADAM_MODE)1, "
                       "false>, double*, double, double, double, double, double, bool, double*, double*>"
                       "(at::native::(anonymous namespace)::TensorListMetadata<4>, at::native::(anonymous namespace)::"
                       "FusedAdamMathFunctor<float, 4, (at::native::ADAM_MODE)1, false>, double*, double, double, "
                       "double, double, double, bool, double*, double*)",
}
GEMM_LAYOUT = {"mlp_fwd": "tn", "mlp_bwd": "nn", "head_fwd": "tn", "head_bwd": "nt"}
NCCL_VERSION = {True: "2.21.5", False: "2.14.3"}
DEVICE = {"id": 0, "name": "NVIDIA H100 80GB HBM3", "totalGlobalMem": 85031714816, "computeMajor": 9,
          "computeMinor": 0, "maxThreadsPerBlock": 1024, "maxThreadsPerMultiprocessor": 2048,
          "regsPerBlock": 65536, "warpSize": 32, "sharedMemPerBlock": 49152, "numSms": 132}


def new_nccl(seed: int) -> bool:
    return seed % 2 == 0


def kernel_name(op: Op, new: bool) -> str:
    if op.kind == "compute":
        if op.name in GEMM_LAYOUT:
            return _GEMM[new].format(t=GEMM_LAYOUT[op.name])
        return KERNELS[op.name]
    body = (_NEW_KERNEL if new else _OLD_KERNEL)[op.name].format(dt=_DT[new][op.dtype])
    if new:
        return f"ncclDevKernel_{body}(ncclDevKernelArgsStorage<4096ul>)"
    return f"ncclKernel_{body}(ncclDevComm*, unsigned long, ncclWork*)"


def process_id(rank: int) -> int:
    """The simulated rank's process id (its CPU events' pid)."""
    return 100_000 + 17 * rank


class RankWriter:
    """Builds one rank's trace document."""

    def __init__(self, views: Views, clocks: Clocks, names: str, seed: int, world: int, detail: bool = False) -> None:
        self.views, self.clocks, self.names, self.seed, self.world = views, clocks, names, seed, world
        self.detail = detail
        self.new = new_nccl(seed)

    def comm_args(self, op: Op, r: int) -> dict:
        g = self.views.group(op, r)
        ranks = list(g.ranks)
        args = {"Collective name": COLL_NAME[op.name], "In msg nelems": op.in_nelems, "Out msg nelems": op.out_nelems,
                "Group size": len(ranks), "dtype": op.dtype, "In split size": "[]", "Out split size": "[]",
                "Process Group Name": g.name, "Process Group Description": g.desc,
                "Process Group Ranks": json.dumps(ranks)}
        if self.new and op.kind == "collective":  # p2p: no peer, no Seq (ProcessGroupNCCL's older records)
            args["Seq"] = op.seq
            args["Rank"] = ranks.index(r)  # torch 2.13: the group-local rank of a collective's caller
        return args

    def document(self, view: RankOps) -> dict:
        r = view.rank
        rng = np.random.default_rng([self.seed, 3, r])
        cpu_pid, device = process_id(r), r % self.clocks.rph
        ts = self.clocks.ts_us(r, view.start).tolist()
        te = self.clocks.ts_us(r, view.end).tolist()
        lead = (rng.uniform(0.015, 0.08, len(view.ops)) * 1e3).tolist()  # the CPU runs ahead of the GPU (us)
        issued, done = np.isfinite(view.start).tolist(), np.isfinite(view.end).tolist()
        events: list[dict] = []
        ext = 0
        cpu = lambda name, cat, t, dur, args: events.append(  # noqa: E731
            {"ph": "X", "cat": cat, "name": name, "pid": cpu_pid, "tid": cpu_pid, "ts": round(t, 3),
             "dur": round(dur, 3), "args": args})
        last = np.full(len(view.step_start), -np.inf)
        for i, op in enumerate(view.ops):
            if not issued[i]:
                continue
            ext += 1
            t_cpu = ts[i] - lead[i]
            last[op.step] = max(last[op.step], te[i] if done[i] else ts[i])
            if op.kind != "compute":
                meta = self.comm_args(op, r)
                g = self.views.group(op, r)
                stride = g.ranks[1] - g.ranks[0] if len(g.ranks) > 1 else 1
                cpu("record_param_comms", "cpu_op", t_cpu, 12.0,
                    {"External id": ext, "Record function id": ext, "Ev Idx": ext, **meta,
                     "Global rank start": g.ranks[0], "Global rank stride": stride})
                if self.detail:
                    cpu(PROFILING_NAME[op.name], "user_annotation", t_cpu + 1.0, 10.0, {"External id": ext})
            elif self.detail:
                cpu(ATEN[op.name], "cpu_op", t_cpu - 2.0, 14.0,
                    {"External id": ext, "Record function id": ext, "Ev Idx": ext})
            cpu("cudaLaunchKernel", "cuda_runtime", t_cpu + 6.0, 4.0,
                {"External id": ext, "cbid": 211, "correlation": ext})
            if not done[i]:
                continue  # issued, never completed: CUPTI records no kernel
            stream = self.views.stream(op, r)
            kargs = {"External id": ext, "queued": 0, "device": device, "context": 1, "stream": stream,
                     "correlation": ext, "registers per thread": 96 if op.kind != "compute" else 168,
                     "shared memory": 87568 if op.kind != "compute" else 114688,
                     "grid": [16, 1, 1] if op.kind != "compute" else [132, 2, 1], "block": [512, 1, 1]}
            if op.kind != "compute":
                kargs.update(meta)
            events.append({"ph": "X", "cat": "kernel", "name": kernel_name(op, self.new), "pid": device,
                           "tid": stream, "ts": round(ts[i], 3), "dur": round(te[i] - ts[i], 3), "args": kargs})
            if self.detail:  # the launch -> kernel flow
                events.append({"ph": "s", "id": ext, "pid": cpu_pid, "tid": cpu_pid, "ts": round(t_cpu + 6.0, 3),
                               "cat": "ac2g", "name": "ac2g"})
                events.append({"ph": "f", "id": ext, "pid": device, "tid": stream, "ts": round(ts[i], 3),
                               "cat": "ac2g", "name": "ac2g", "bp": "e"})
        s0 = self.clocks.ts_us(r, view.step_start)
        s1 = self.clocks.ts_us(r, view.step_end)
        for s in range(len(s0)):
            if not np.isfinite(s0[s]):
                continue
            end = s1[s] if np.isfinite(s1[s]) else max(last[s], s0[s])  # a hung step: cut at its last event
            cpu(f"ProfilerStep#{s}", "user_annotation", s0[s] - 50.0, end - s0[s] + 60.0,
                {"External id": 0, "Record function id": 0})
        events.sort(key=lambda e: e["ts"])
        return {"schemaVersion": 1, "deviceProperties": [DEVICE], "distributedInfo": self.info(r),
                "traceEvents": events + self.metadata(cpu_pid, device), "traceName": f"rank{r}.json",
                "displayTimeUnit": "ms", "baseTimeNanoseconds": self.clocks.base_ns(r)}

    def info(self, r: int) -> dict:
        base = {"backend": "nccl", "rank": r, "world_size": self.world}
        if self.names == "none":
            return base
        pgs = [{"pg_name": g.name, "pg_desc": g.desc, "backend_config": "cuda:nccl", "pg_size": len(g.ranks),
                "ranks": list(g.ranks)} for g in self.views.groups.member_of(r)]
        return {**base, "pg_count": len(pgs), "pg_config": pgs, "nccl_version": NCCL_VERSION[self.new]}

    @staticmethod
    def metadata(cpu_pid: int, device: int) -> list[dict]:
        out = [{"name": "process_name", "ph": "M", "ts": 0, "pid": cpu_pid, "tid": 0, "args": {"name": "python3.11"}},
               {"name": "process_name", "ph": "M", "ts": 0, "pid": device, "tid": 0, "args": {"name": "python3.11"}},
               {"name": "process_labels", "ph": "M", "ts": 0, "pid": device, "tid": 0,
                "args": {"labels": f"GPU {device}"}},
               {"name": "thread_name", "ph": "M", "ts": 0, "pid": cpu_pid, "tid": cpu_pid,
                "args": {"name": f"thread {cpu_pid} (pt_main_thread)"}}]
        return out


def write(path: Path, doc: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(doc, separators=(",", ":"))  # dumps, not dump: dump skips the C encoder
    with gzip.open(path, "wb", compresslevel=3) as f:
        f.write(text.encode())
