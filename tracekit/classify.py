"""THE one place that decides what a trace event is: a collective, a p2p op, or neither.

Ingest and every analysis ask this module, never their own prefix lists. The rules are data
(the tuples and dicts below) rendered two ways: :func:`classify` for Python callers and
:func:`sql_comm_class` / :func:`sql_comm_op` for columnar paths that classify inside DuckDB.

What counts as communication (FORMATS.md section 1):
- NCCL GPU kernels ``ncclKernel_*`` (older NCCL) and ``ncclDevKernel_*`` (newer): the real run time;
- ``record_param_comms`` cpu ops and ``nccl:*`` annotations: the CPU-side enqueue on NCCL;
- gloo worker spans ``gloo:*``: the real run time on gloo;
- ``c10d::*`` cpu ops: the CPU-side enqueue of any backend;
- the trainer's ``tk.comm ...`` spans (tracekit.conventions), which carry group and sequence.
"""

from __future__ import annotations

from tracekit.conventions import COMM_PREFIX, P2P_OPS, parse_comm

COLLECTIVE = "collective"
P2P = "p2p"
NONE = "none"

NCCL_KERNEL_PREFIXES: tuple[str, ...] = ("ncclKernel_", "ncclDevKernel_")
SPAN_PREFIXES: tuple[str, ...] = ("gloo:", "nccl:", "c10d::")  # prefix + op name
PARAM_COMMS = "record_param_comms"

# Every spelling of an op seen in kernel names, record_param_comms args, gloo/nccl/c10d spans and
# flight-recorder profiling names, mapped to one vocabulary.
OP_ALIASES: dict[str, str] = {
    "allreduce": "all_reduce", "all_reduce": "all_reduce", "allreduce_": "all_reduce",
    "allreduce_coalesced": "all_reduce", "allreduce_coalesced_": "all_reduce",
    "allgather": "all_gather", "all_gather": "all_gather", "allgather_": "all_gather",
    "_allgather_base": "all_gather", "_allgather_base_": "all_gather",
    "_all_gather_base": "all_gather",  # ProcessGroupNCCL's profiling name (FR, nccl: spans)
    "all_gather_into_tensor": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
    "allgather_into_tensor_coalesced": "all_gather", "allgather_into_tensor_coalesced_": "all_gather",
    "allgather_coalesced": "all_gather", "allgather_coalesced_": "all_gather",
    "reducescatter": "reduce_scatter", "reduce_scatter": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter",
    "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter", "reducescatter_": "reduce_scatter",
    "broadcast": "broadcast", "broadcast_": "broadcast",
    "reduce": "reduce", "reduce_": "reduce",
    "alltoall": "all_to_all", "all_to_all": "all_to_all", "alltoall_base": "all_to_all",
    "alltoall_base_": "all_to_all", "all_to_all_single": "all_to_all", "alltoall_": "all_to_all",
    "barrier": "barrier", "barrier_": "barrier",
    "gather": "gather", "gather_": "gather", "scatter": "scatter", "scatter_": "scatter",
    "send": "send", "send_": "send", "isend": "send", "recv": "recv", "recv_": "recv",
    "irecv": "recv", "recv_any_source_": "recv", "sendrecv": "sendrecv",
}
P2P_NORMALIZED = frozenset({"send", "recv", "sendrecv"})
assert {OP_ALIASES.get(o, o) for o in P2P_OPS} <= P2P_NORMALIZED


def normalize_op(op: str) -> str:
    """One name per operation: 'allreduce', 'AllReduce', 'allreduce_' -> 'all_reduce'."""
    key = op.strip().lower()
    return OP_ALIASES.get(key, key)


def kernel_op(name: str) -> str | None:
    """The op of an NCCL kernel name ('ncclDevKernel_AllGather_RING_LL' -> 'all_gather'), else None."""
    for prefix in NCCL_KERNEL_PREFIXES:
        if name.startswith(prefix):
            word = name[len(prefix):].split("_", 1)[0].split("(", 1)[0]
            return normalize_op(word)
    return None


def comm_op(name: str) -> str | None:
    """The normalized op a communication event performs, None if it is not communication.

    record_param_comms carries its op in args, not in its name: it returns '' here.
    """
    op = kernel_op(name)
    if op is not None:
        return op
    if name.startswith(COMM_PREFIX):
        ann = parse_comm(name)
        return normalize_op(ann.op) if ann else None
    for prefix in SPAN_PREFIXES:
        if name.startswith(prefix):
            # 'nccl:send 0->1' (flight recorder p2p names) -> 'send'
            return normalize_op(name[len(prefix):].split(" ", 1)[0])
    if name == PARAM_COMMS:
        return ""
    return None


def classify(name: str, op_arg: str | None = None) -> str:
    """'collective', 'p2p' or 'none' for one event name (``op_arg``: a 'Collective name' arg)."""
    op = comm_op(name)
    if op is None:
        return NONE
    if op_arg:
        op = normalize_op(op_arg)
    return P2P if op in P2P_NORMALIZED else COLLECTIVE


def is_comm(name: str) -> bool:
    return comm_op(name) is not None


def has_comm_name(name: str) -> bool:
    """Is the event communication by its name's prefix alone (what :func:`sql_is_comm` says)? Unlike
    :func:`is_comm`, a malformed ``tk.comm`` name counts: ingest keeps its row with the others."""
    return name.startswith(NCCL_KERNEL_PREFIXES + SPAN_PREFIXES + (COMM_PREFIX,)) or name == PARAM_COMMS


# ---- the same rules rendered as SQL (DuckDB), for columnar ingest ------------------------------
def _sql_str(s: str) -> str:
    return "'" + s.replace("'", "''") + "'"


def sql_is_comm(name: str) -> str:
    """SQL boolean: is the event named by column ``name`` communication (any side, any backend)?"""
    tests = [f"starts_with({name}, {_sql_str(p)})" for p in NCCL_KERNEL_PREFIXES + SPAN_PREFIXES]
    tests += [f"starts_with({name}, {_sql_str(COMM_PREFIX)})", f"{name} = {_sql_str(PARAM_COMMS)}"]
    return "(" + " OR ".join(tests) + ")"


def sql_normalize_op(expr: str) -> str:
    """SQL expression mapping a raw op spelling to the normalized vocabulary (unknown: lowercased)."""
    cases = " ".join(f"WHEN {_sql_str(k)} THEN {_sql_str(v)}" for k, v in OP_ALIASES.items())
    return f"(CASE lower({expr}) {cases} ELSE lower({expr}) END)"


def sql_kernel_op(name: str) -> str:
    """SQL: normalized op of an NCCL kernel name, NULL for any other name."""
    word = f"regexp_extract({name}, '^nccl(?:Dev)?Kernel_([A-Za-z0-9]+)', 1)"
    return f"(CASE WHEN {word} = '' THEN NULL ELSE {sql_normalize_op(word)} END)"


def sql_span_op(name: str) -> str:
    """SQL: normalized op of a gloo:/nccl:/c10d:: span name, NULL for any other name."""
    alts = "|".join(p.replace(":", "\\:") for p in SPAN_PREFIXES)
    word = f"regexp_extract({name}, '^(?:{alts})([A-Za-z0-9_]+)', 1)"
    return f"(CASE WHEN {word} = '' THEN NULL ELSE {sql_normalize_op(word)} END)"


def sql_is_p2p(op_expr: str) -> str:
    return f"({op_expr} IN ({', '.join(_sql_str(o) for o in sorted(P2P_NORMALIZED))}))"
