"""Reading the trainer's own spans back from a Chrome trace, shared by the observability tests."""

from __future__ import annotations


def exclusive_compute_ms(trace: dict) -> float:
    """Compute spans minus the comm spans nested in them, on the same thread."""
    ev = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    comp = [e for e in ev if e["name"].startswith("tk.compute ")]
    comm = [e for e in ev if e["name"].startswith("tk.comm ")]
    inner = sum(c["dur"] for c in comm for s in comp
                if s["tid"] == c["tid"] and s["ts"] <= c["ts"] and c["ts"] + c["dur"] <= s["ts"] + s["dur"])
    return (sum(s["dur"] for s in comp) - inner) / 1e3
