"""Bitwise comparison of two named tensor collections (loss, gradients, parameters).

Elementwise relative error is useless near zero, so a buffer is judged by: how many elements differ
in their bit pattern, the distance in ULPs (units in the last place, counted on the dtype's own bit
pattern, sign-aware: the number of representable values between the two), a histogram of those
distances, the max absolute error and the normwise relative error ``||a - b||_2 / ||b||_2`` (in fp64,
``b`` the expected side). The first diverging buffer in a caller-given order (e.g. backward order)
names where a bug entered.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping, Sequence

import numpy as np
import polars as pl
import torch

_INT_VIEW = {
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
    torch.float32: torch.int32,
    torch.float64: torch.int64,
}


def _bits(t: torch.Tensor) -> np.ndarray:
    if t.dtype not in _INT_VIEW:
        raise ValueError(f"bitwise comparison supports {sorted(map(str, _INT_VIEW))}, got {t.dtype}")
    return t.detach().cpu().contiguous().reshape(-1).view(_INT_VIEW[t.dtype]).numpy().astype(np.int64)


def bit_mismatches(actual: torch.Tensor, expected: torch.Tensor) -> int:
    """Number of elements whose bit patterns differ (the definition of "not bit-exact" everywhere)."""
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        raise ValueError(f"cannot compare {tuple(actual.shape)} {actual.dtype} with {tuple(expected.shape)} {expected.dtype}")
    if actual.dtype not in _INT_VIEW:
        raise ValueError(f"bitwise comparison supports {sorted(map(str, _INT_VIEW))}, got {actual.dtype}")
    view = _INT_VIEW[actual.dtype]
    a, b = (t.detach().cpu().contiguous().reshape(-1).view(view) for t in (actual, expected))
    return int((a != b).sum())


def _ordered_keys(bits: np.ndarray, nbits: int) -> np.ndarray:
    """Map sign-magnitude float bits to integers whose order and differences follow the float line
    (+0 and -0 both map to 0, the smallest subnormals to +-1)."""
    magnitude = bits & np.int64((1 << (nbits - 1)) - 1)
    return np.where(bits < 0, -magnitude, magnitude)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> np.ndarray:
    """Elementwise distance in ULPs of ``a``'s dtype, as uint64 (exact for every dtype, fp64 included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        raise ValueError(f"cannot compare {tuple(a.shape)} {a.dtype} with {tuple(b.shape)} {b.dtype}")
    nbits = a.element_size() * 8
    ka = _ordered_keys(_bits(a), nbits).view(np.uint64)
    kb = _ordered_keys(_bits(b), nbits).view(np.uint64)
    # Two's-complement subtraction modulo 2**64 gives the exact distance in the right direction.
    return np.where(ka.view(np.int64) >= kb.view(np.int64), ka - kb, kb - ka)


def _bit_length(d: np.ndarray) -> np.ndarray:
    """Exact bit length of uint64 values (0 -> 0, 1 -> 1, 2..3 -> 2, ...)."""
    d = d.copy()
    out = np.zeros(d.shape, dtype=np.int64)
    for shift in (32, 16, 8, 4, 2, 1):
        big = d >= np.uint64(1 << shift)
        d[big] >>= np.uint64(shift)
        out[big] += shift
    return out + (d > 0)


@dataclass(frozen=True)
class BufferDiff:
    """How one buffer of ``actual`` differs from the same buffer of ``expected``."""

    name: str
    dtype: str
    numel: int
    mismatches: int  # elements whose bit patterns differ (so -0.0 vs +0.0 counts)
    max_ulp: int
    max_abs_err: float
    rel_err: float  # normwise, fp64; inf if expected is all zeros and actual is not
    nan_mismatches: int  # elements that are NaN on exactly one side
    ulp_hist: dict[int, int] = field(default_factory=dict)  # bit length of ULP distance -> count

    @property
    def bit_exact(self) -> bool:
        return self.mismatches == 0

    @property
    def module(self) -> str:
        """The owning module of a parameter-style name (``layers.1.attn.wq.weight`` -> ``layers.1.attn.wq``);
        an activation (``act/layers.0.attention``) names its module itself."""
        if self.name.startswith("act/"):
            return self.name[4:]
        return self.name.rsplit(".", 1)[0] if "." in self.name else self.name


def diff_buffer(name: str, actual: torch.Tensor, expected: torch.Tensor,
                dtype: torch.dtype | None = None) -> BufferDiff:
    """Compare one pair of tensors of the same shape and dtype, bit for bit. ``dtype``: the dtype the
    values were last rounded to (a bf16 gradient stored as fp32): ULPs are counted in it, so one bf16
    step is 1 ULP, not 65,536 fp32 ULPs."""
    if actual.dtype != expected.dtype or actual.shape != expected.shape:
        raise ValueError(
            f"buffer {name!r}: actual is {tuple(actual.shape)} {actual.dtype}, "
            f"expected is {tuple(expected.shape)} {expected.dtype}"
        )
    mismatches = bit_mismatches(actual, expected)
    unit = actual.dtype if dtype is None or dtype not in _INT_VIEW else dtype
    ulps = ulp_distance(actual.to(unit), expected.to(unit))
    if mismatches and unit != actual.dtype:  # bits that differ below the unit still count one
        ulps = np.maximum(ulps, (_bits(actual) != _bits(expected)).astype(np.uint64))
    a = actual.detach().cpu().reshape(-1).double().numpy()
    b = expected.detach().cpu().reshape(-1).double().numpy()
    a_nan, b_nan = np.isnan(a), np.isnan(b)
    nan_mismatches = int(np.count_nonzero(a_nan != b_nan))
    with np.errstate(invalid="ignore", over="ignore"):
        err = np.abs(a - b)
    err[a_nan & b_nan] = 0.0
    err[a_nan != b_nan] = np.inf
    err[a == b] = 0.0  # inf - inf of equal infinities
    with np.errstate(over="ignore"):
        ref_norm = float(np.linalg.norm(np.where(b_nan, 0.0, b)))
        err_norm = float(np.linalg.norm(err))
    rel = err_norm / ref_norm if ref_norm > 0 else (0.0 if err_norm == 0 else float("inf"))
    buckets, counts = np.unique(_bit_length(ulps), return_counts=True)
    return BufferDiff(
        name=name,
        dtype=str(unit).removeprefix("torch."),
        numel=actual.numel(),
        mismatches=mismatches,
        max_ulp=int(ulps.max()) if ulps.size else 0,
        max_abs_err=float(err.max()) if err.size else 0.0,
        rel_err=rel,
        nan_mismatches=nan_mismatches,
        ulp_hist={int(k): int(c) for k, c in zip(buckets, counts)},
    )


@dataclass(frozen=True)
class Comparison:
    """Per-buffer differences, in the comparison order."""

    buffers: tuple[BufferDiff, ...]

    @property
    def bit_exact(self) -> bool:
        return all(b.bit_exact for b in self.buffers)

    @property
    def first_divergent(self) -> BufferDiff | None:
        """The first buffer, in comparison order, whose bits differ; None when all match."""
        return next((b for b in self.buffers if not b.bit_exact), None)

    def table(self) -> pl.DataFrame:
        """One row per buffer, in comparison order."""
        return pl.DataFrame(
            {
                "buffer": [b.name for b in self.buffers],
                "module": [b.module for b in self.buffers],
                "dtype": [b.dtype for b in self.buffers],
                "numel": [b.numel for b in self.buffers],
                "mismatches": [b.mismatches for b in self.buffers],
                "max_ulp": [b.max_ulp for b in self.buffers],
                "max_abs_err": [b.max_abs_err for b in self.buffers],
                "rel_err": [b.rel_err for b in self.buffers],
                "nan_mismatches": [b.nan_mismatches for b in self.buffers],
            },
            schema_overrides={"numel": pl.Int64, "mismatches": pl.Int64, "max_ulp": pl.UInt64},
        )

    def ulp_histogram(self) -> pl.DataFrame:
        """Long form: buffer, ulp_min, ulp_max (inclusive), count; ULP 0 is the bucket [0, 0]."""
        rows = [
            (b.name, 0 if k == 0 else 1 << (k - 1), 0 if k == 0 else (1 << k) - 1, c)
            for b in self.buffers
            for k, c in sorted(b.ulp_hist.items())
        ]
        return pl.DataFrame(
            rows, schema={"buffer": pl.String, "ulp_min": pl.UInt64, "ulp_max": pl.UInt64, "count": pl.Int64}, orient="row"
        )


def compare(
    actual: Mapping[str, torch.Tensor],
    expected: Mapping[str, torch.Tensor],
    order: Sequence[str] | None = None,
    dtypes: Mapping[str, torch.dtype] | None = None,
) -> Comparison:
    """Compare two collections buffer by buffer. ``order`` (default: ``expected``'s order) must list
    every name exactly once; it decides which buffer is reported as the first divergent one.
    ``dtypes``: per buffer, the dtype to count ULPs in (default: the tensor's own)."""
    only_actual = sorted(set(actual) - set(expected))
    only_expected = sorted(set(expected) - set(actual))
    if only_actual or only_expected:
        raise ValueError(f"buffer names differ: only in actual {only_actual}, only in expected {only_expected}")
    names = list(expected) if order is None else list(order)
    if len(names) != len(set(names)) or set(names) != set(expected):
        missing = sorted(set(expected) - set(names))
        unknown = sorted(set(names) - set(expected))
        raise ValueError(f"order must list every buffer once: missing {missing}, unknown {unknown}, or repeated names")
    return Comparison(tuple(diff_buffer(n, actual[n], expected[n], (dtypes or {}).get(n)) for n in names))


def assert_bit_exact(
    actual: Mapping[str, torch.Tensor],
    expected: Mapping[str, torch.Tensor],
    order: Sequence[str] | None = None,
) -> Comparison:
    """pytest-friendly: raise AssertionError naming the first divergent buffer, with the table."""
    result = compare(actual, expected, order)
    first = result.first_divergent
    if first is not None:
        bad = result.table().filter(pl.col("mismatches") > 0)
        with pl.Config(tbl_rows=-1, tbl_cols=-1, tbl_width_chars=200):
            raise AssertionError(
                f"not bit-exact: first divergent buffer {first.name!r} (module {first.module}): "
                f"{first.mismatches}/{first.numel} elements differ, max {first.max_ulp} ULP, "
                f"normwise rel. error {first.rel_err:.3g}\n{bad}"
            )
    return result
