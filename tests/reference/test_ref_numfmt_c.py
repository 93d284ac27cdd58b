#!/usr/bin/python3
"""The reference's number formats against kernels/cpu/numfmt (through numfmt_probe), bit for bit,
on random values and on constructed ties, saturation and subnormal cases. Two implementations
of MODEL.md §3.1-3.2 written apart; a mismatch means one of them misreads the spec.

Usage: test_ref_numfmt_c.py PROBE   (meson passes the numfmt_probe executable)"""

import os
import subprocess
import sys
import tempfile
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import v41_ref as ref  # noqa: E402

PROBE = None
RNG = np.random.default_rng(20260)


def probe(mode, x):
    x = np.ascontiguousarray(x, dtype="<f4")
    with tempfile.TemporaryDirectory() as d:
        src, dst = os.path.join(d, "in"), os.path.join(d, "out")
        x.tofile(src)
        p = subprocess.run([PROBE, mode, src, dst], capture_output=True, text=True, timeout=60)
        if p.returncode != 0:
            raise AssertionError(f"numfmt_probe {mode}: {p.stderr.strip()}")
        return np.fromfile(dst, dtype="<f4")


def log_uniform(n, lo, hi):
    mag = np.exp2(RNG.uniform(lo, hi, n))
    return (mag * RNG.choice([-1.0, 1.0], n)).astype(np.float32)


def midpoints(grid):
    g = np.unique(np.asarray(grid, dtype=np.float64))
    mids = (g[:-1] + g[1:]) / 2
    return np.concatenate([mids, -mids]).astype(np.float32)


class AgainstC(unittest.TestCase):
    def check(self, mode, x, ours):
        x = np.asarray(x, dtype=np.float32)
        c = probe(mode, x)
        r = np.asarray(ours(x), dtype=np.float32).reshape(-1)
        cu, ru = c.view(np.uint32), r.view(np.uint32)
        nan_both = np.isnan(c) & np.isnan(r)
        bad = np.nonzero((cu != ru) & ~nan_both)[0]
        if bad.size:
            i = bad[0]
            self.fail(f"{mode}: {bad.size} of {x.size} differ; first x={x[i]!r} "
                      f"C={c[i]!r} reference={r[i]!r}")

    def test_bf16(self):
        bits = RNG.integers(0, 2 ** 32, 200000, dtype=np.uint64).astype(np.uint32)
        ties = (RNG.integers(0, 2 ** 16, 20000, dtype=np.uint64).astype(np.uint32) << 16) | 0x8000
        x = np.concatenate([bits, ties]).view(np.float32)
        x = x[~np.isnan(x)]
        self.check("bf16", x, ref.bf16)

    def test_e4m3(self):
        grid = ref.e4m3_decode(np.arange(0, 127))
        x = np.concatenate([log_uniform(100000, -14, 10), midpoints(grid),
                            np.float32([0, -0.0, 448, -448, 449, 464, 470, 1e30, -1e30])])
        self.check("e4m3", x, ref.e4m3_round)

    def test_e2m1(self):
        x = np.concatenate([RNG.uniform(-6, 6, 50000).astype(np.float32),
                            midpoints(ref.E2M1_VALUES), np.float32([0, -0.0, 6, -6])])
        self.check("e2m1", x, ref.e2m1_round)

    def blocks(self, n_blocks, width):
        """Blocks with amax spread over many binades, some exactly at scale boundaries, one all
        zero, one with a single tiny value."""
        out = []
        for b in range(n_blocks):
            amax_exp = RNG.uniform(-40, 30)
            v = RNG.standard_normal(width) * np.exp2(amax_exp)
            if b % 7 == 0:
                v[RNG.integers(width)] = 448.0 * 2.0 ** RNG.integers(-20, 10)
            if b % 11 == 0:
                v[RNG.integers(width)] = 6.0 * 2.0 ** RNG.integers(-20, 10)
            out.append(v)
        out.append(np.zeros(width))
        tiny = np.zeros(width)
        tiny[3] = 1e-6
        out.append(tiny)
        return np.concatenate(out).astype(np.float32)

    def test_procedure_a(self):
        self.check("fq8", self.blocks(3000, 32), ref.quant_a)

    def test_procedure_b(self):
        self.check("fq4", self.blocks(3000, 32), ref.quant_b)

    def test_procedure_c(self):
        x = self.blocks(3000, 16)
        # amax / 6 right at E4M3 midpoints: the scale's own rounding decides
        mids = midpoints(ref.e4m3_decode(np.arange(1, 127)))
        mids = mids[mids > 0][:200]
        extra = np.zeros((mids.size, 16), dtype=np.float32)
        extra[:, 0] = mids * np.float32(6)
        extra[:, 1:] = RNG.uniform(-1, 1, (mids.size, 15)) * extra[:, :1]
        self.check("fq4c", np.concatenate([x, extra.reshape(-1)]), ref.quant_c)


if __name__ == "__main__":
    if len(sys.argv) < 2 or not os.access(sys.argv[1], os.X_OK):
        print("usage: test_ref_numfmt_c.py PROBE (the numfmt_probe executable)", file=sys.stderr)
        sys.exit(2)
    PROBE = sys.argv.pop(1)
    unittest.main()
