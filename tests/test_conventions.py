import pytest

from tracekit.conventions import (
    CommAnnotation,
    ComputeAnnotation,
    ConventionError,
    parse_comm,
    parse_compute,
)


def test_comm_roundtrip():
    a = CommAnnotation(op="all_gather", pg="5", dim="cp", seq=17, ranks=(0, 2), nbytes=4096,
                       dtype="bfloat16")
    assert parse_comm(a.span_name()) == a
    p = CommAnnotation(op="send", pg="9", dim="pp", seq=3, ranks=(0, 4), nbytes=8, dtype="float32",
                       peer=4)
    back = parse_comm(p.span_name())
    assert back == p and back.is_p2p


def test_compute_roundtrip_and_non_matching():
    c = ComputeAnnotation(phase="bwd", vstage=3, mb=1)
    assert parse_compute(c.span_name()) == c
    assert parse_comm("gloo:all_reduce") is None
    assert parse_compute("aten::mm") is None


def test_malformed_raises():
    with pytest.raises(ConventionError):
        parse_comm("tk.comm op=all_reduce seq=notanint pg=1 ranks=0,1")
    with pytest.raises(ConventionError):
        parse_comm("tk.comm garbage")
