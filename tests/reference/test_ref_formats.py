#!/usr/bin/python3
"""Element formats and quantisation procedures of the reference (MODEL.md §3.1-3.2) against
values computed by hand, and the safetensors reader against hand-built files."""

import json
import math
import os
import struct
import sys
import tempfile
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import v41_ref as ref  # noqa: E402

NAN = float("nan")


def same(a, b):
    """Element-wise equality that treats NaN == NaN and keeps the sign of zero apart."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    both_nan = np.isnan(a) & np.isnan(b)
    eq = (a == b) & (np.signbit(a) == np.signbit(b))
    return bool(np.all(both_nan | eq))


class Bf16(unittest.TestCase):
    def test_exact_and_ties(self):
        cases = [
            (1.0, 1.0),
            (1 + 2 ** -8, 1.0),                       # tie, 1.0 has the even mantissa
            (1 + 3 * 2 ** -8, 1 + 2 ** -6),           # tie, rounds up to the even mantissa
            (1 + 2 ** -8 + 2 ** -20, 1 + 2 ** -7),    # just above the tie
            (-(1 + 2 ** -8), -1.0),
            (3.0 * 2 ** -134, 2 ** -132),             # subnormal tie goes to even
            (2 ** -134, 0.0),                         # subnormal tie goes to zero
            (2 ** -133, 2 ** -133),                   # smallest bf16 subnormal is kept
            (3.4028234663852886e38, math.inf),        # fp32 max rounds past the bf16 max
            (-0.0, -0.0),
        ]
        for x, want in cases:
            self.assertTrue(same(ref.bf16(np.float32(x)), want), f"bf16({x!r})")

    def test_nan_stays_nan(self):
        self.assertTrue(np.isnan(ref.bf16(np.float32(NAN))))


class E4m3(unittest.TestCase):
    def test_round(self):
        cases = [
            (448, 448), (500, 448), (-1000, -448),
            (470, 448),                  # unclamped it would round to 480
            (17, 16),                    # tie between 16 (even) and 18
            (19, 20),                    # tie between 18 and 20 (even)
            (1.0625, 1.0), (1.1875, 1.25),
            (2 ** -9, 2 ** -9),          # smallest subnormal
            (2 ** -10, 0.0),             # tie between 0 and 2^-9 goes to 0
            (3 * 2 ** -10, 2 ** -8),     # tie between 2^-9 (odd) and 2^-8 (even)
            (5 * 2 ** -10, 2 ** -8),     # tie between 2^-8 (even) and 3 * 2^-9
            (0.9 * 2 ** -9, 2 ** -9),
            (2 ** -6, 2 ** -6),          # smallest normal
            (-0.3, -0.3125),
        ]
        for x, want in cases:
            self.assertTrue(same(ref.e4m3_round(x), want), f"e4m3({x!r})")

    def test_codes(self):
        for value, code in [(448, 0x7E), (1, 0x38), (-1, 0xB8), (2 ** -9, 0x01),
                            (2 ** -6, 0x08), (0, 0x00), (-448, 0xFE), (1.5, 0x3C)]:
            self.assertEqual(int(ref.e4m3_encode(value)), code, f"encode {value}")
            self.assertTrue(same(ref.e4m3_decode(code), value), f"decode {code:#x}")
        self.assertTrue(np.isnan(ref.e4m3_decode(0x7F)))
        self.assertTrue(np.isnan(ref.e4m3_decode(0xFF)))
        self.assertTrue(same(ref.e4m3_decode(0x80), -0.0))

    def test_encode_rejects_off_grid(self):
        with self.assertRaises(ValueError):
            ref.e4m3_encode(1.1)


class Ue8m0(unittest.TestCase):
    def test_decode(self):
        self.assertEqual(float(ref.ue8m0_decode(127)), 1.0)
        self.assertEqual(float(ref.ue8m0_decode(0)), 2.0 ** -127)
        self.assertEqual(float(ref.ue8m0_decode(254)), 2.0 ** 127)
        self.assertTrue(np.isnan(ref.ue8m0_decode(255)))

    def test_ceil_from_bits(self):
        for y, byte in [(1.0, 127), (1.5, 128), (0.75, 127), (2.0 ** -126, 1), (3.0, 129),
                        (2.0, 128), (1.0000001, 128)]:
            self.assertEqual(int(ref.ue8m0_ceil(np.float32(y))), byte, f"ceil({y})")


class E2m1(unittest.TestCase):
    def test_ties_to_even_code(self):
        cases = [(0.25, 0.0), (0.75, 1.0), (1.25, 1.0), (1.75, 2.0), (2.5, 2.0), (3.5, 4.0),
                 (5.0, 4.0), (6.0, 6.0), (0.3, 0.5), (2.6, 3.0), (-0.75, -1.0), (-5.5, -6.0),
                 (0.2, 0.0)]
        for x, want in cases:
            self.assertTrue(same(ref.e2m1_round(x), want), f"e2m1({x})")

    def test_codes(self):
        self.assertEqual(list(ref.e2m1_codes([0, 0.5, 1, 1.5, 2, 3, 4, 6])), list(range(8)))
        self.assertEqual(list(ref.e2m1_codes([-0.5, -6])), [9, 15])


def block(first, n=32):
    x = np.zeros(n, dtype=np.float32)
    x[: len(first)] = first
    return x


class Procedures(unittest.TestCase):
    def test_a(self):
        # a = 1: 1 * fp32(1/448) = 1.142857 * 2^-9, mantissa non-zero -> 2^-8 (byte 119)
        q, sb = ref.quant_a_parts(block([1.0, 0.3]))
        self.assertEqual(int(sb[0]), 119)
        self.assertTrue(same(ref.quant_a(block([1.0, 0.3]))[:2], [1.0, 0.3125]))
        # a = 448: 448 * fp32(1/448) rounds to exactly 1.0 -> scale 1
        self.assertEqual(int(ref.quant_a_parts(block([448.0]))[1][0]), 127)
        self.assertTrue(same(ref.quant_a(block([448.0, 1e-3]))[:2], [448.0, 2 ** -9]))
        # a = 449: scale 2; 224.5 rounds to 224 (grid step 16 in [128, 256))
        self.assertEqual(int(ref.quant_a_parts(block([449.0]))[1][0]), 128)
        self.assertTrue(same(ref.quant_a(block([449.0]))[0], 448.0))
        # all-zero block: a = 1e-4 -> 2.232e-7 -> 2^-22 (byte 105), values 0
        q, sb = ref.quant_a_parts(block([]))
        self.assertEqual(int(sb[0]), 105)
        self.assertTrue(same(ref.quant_a(block([])), np.zeros(32)))

    def test_a_blocks_are_independent(self):
        x = np.concatenate([block([448.0]), block([1.0])])
        self.assertEqual([int(v) for v in ref.quant_a_parts(x)[1]], [127, 119])

    def test_b(self):
        self.assertTrue(same(ref.quant_b(block([6.0, 3.1]))[:2], [6.0, 3.0]))
        self.assertTrue(same(ref.quant_b(block([12.0, 3.1, 7.0]))[:3], [12.0, 3.0, 8.0]))
        self.assertTrue(same(ref.quant_b(block([6.5]))[0], 6.0))    # scale 2, 3.25 -> 3
        codes, sb = ref.quant_b_parts(block([]))
        self.assertEqual(int(sb[0]), 1)                               # 6 * 2^-126 / 6
        self.assertTrue(same(ref.quant_b(block([])), np.zeros(32)))

    def test_c(self):
        # a = 7: 7 / 6 = 1.1667 -> E4M3 1.125; 7 / 1.125 = 6.22 saturates at 6 -> 6.75
        x = block([7.0, 1.0], 16)
        self.assertTrue(same(ref.quant_c(x)[:2], [6.75, 1.125]))
        # a = 3: scale 0.5; 0.7 / 0.5 = 1.4 -> 1.5 -> 0.75
        self.assertTrue(same(ref.quant_c(block([3.0, 0.7], 16))[:2], [3.0, 0.75]))
        self.assertTrue(same(ref.quant_c(block([], 16)), np.zeros(16)))
        # two blocks of 16 in 32 values use separate scales
        y = np.concatenate([block([7.0], 16), block([3.0], 16)])
        self.assertTrue(same(ref.quant_c(y)[[0, 16]], [6.75, 3.0]))

    def test_width_must_fit_blocks(self):
        with self.assertRaises(ref.RefError):
            ref.quant_a(np.ones(48, dtype=np.float32))


def write_raw_safetensors(path, entries, header_extra=None):
    """entries: name -> (dtype, shape, bytes). Written in a fixed order without padding."""
    header, data, off = {}, b"", 0
    for name, (dtype, shape, raw) in entries.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + len(raw)]}
        data += raw
        off += len(raw)
    header.update(header_extra or {})
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)


class Safetensors(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory()
        self.dir = self.tmp.name

    def tearDown(self):
        self.tmp.cleanup()

    def model(self, entries, header_extra=None):
        write_raw_safetensors(os.path.join(self.dir, "model.safetensors"), entries, header_extra)
        return ref.Checkpoint(self.dir)

    def test_dtypes_decode(self):
        fp4 = bytes([0x2A]) + bytes(31)          # low nibble 0xA = -1.0 first, high 0x2 = 1.0
        ck = self.model({
            "a": ("F32", [2], struct.pack("<2f", 1.5, -2.0)),
            "b": ("BF16", [2], struct.pack("<2H", 0x3FC0, 0xC000)),        # 1.5, -2.0
            "w.weight": ("F8_E4M3", [1, 2], bytes([0x38, 0xB8])),        # 1, -1
            "w.scale": ("F8_E8M0", [1, 1], bytes([128])),                 # x2
            "e.weight": ("I8", [1, 32], fp4),
            "e.scale": ("F8_E8M0", [1, 2], bytes([127, 127])),
        }, {"__metadata__": {"format": "pt"}})
        self.assertTrue(same(ck.plain("a", [2]), [1.5, -2.0]))
        self.assertTrue(same(ck.plain("b", [2]), [1.5, -2.0]))
        self.assertTrue(same(ck.fp8("w.weight", [1, 2]), [[2.0, -2.0]]))
        v = ck.fp4("e.weight", [1, 64])
        self.assertTrue(same(v[0, :3], [-1.0, 1.0, 0.0]))

    def test_fp8_partial_scale_blocks(self):
        # a [33, 2] weight has ceil(33/32) = 2 scale rows; row 32 uses the second one
        w = bytes([0x38]) * 66
        ck = self.model({"w.weight": ("F8_E4M3", [33, 2], w),
                         "w.scale": ("F8_E8M0", [2, 1], bytes([127, 129]))})
        v = ck.fp8("w.weight", [33, 2])
        self.assertEqual(float(v[31, 0]), 1.0)
        self.assertEqual(float(v[32, 1]), 4.0)

    def test_wrong_dtype_and_shape_are_errors(self):
        ck = self.model({"a": ("F32", [2], bytes(8))})
        with self.assertRaisesRegex(ref.RefError, "shape"):
            ck.plain("a", [3])
        with self.assertRaisesRegex(ref.RefError, "dtype F32"):
            ck.fp8("a", [2])
        with self.assertRaisesRegex(ref.RefError, "lacks tensor nope"):
            ck.plain("nope", [1])

    def test_bad_offsets_and_dtype(self):
        with self.assertRaisesRegex(ref.RefError, "data_offsets"):
            self.model({"a": ("F32", [3], bytes(8))})
        with self.assertRaisesRegex(ref.RefError, "unsupported dtype F16"):
            self.model({"a": ("F16", [4], bytes(8))})

    def test_truncated_file(self):
        path = os.path.join(self.dir, "model.safetensors")
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", 1000) + b"{}")
        with self.assertRaisesRegex(ref.RefError, "runs past the end"):
            ref.Checkpoint(self.dir)
        with open(path, "wb") as f:
            f.write(b"\x01\x02")
        with self.assertRaisesRegex(ref.RefError, "shorter than"):
            ref.Checkpoint(self.dir)

    def test_bad_json_header(self):
        path = os.path.join(self.dir, "model.safetensors")
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", 3) + b"{x}")
        with self.assertRaisesRegex(ref.RefError, "bad JSON header"):
            ref.Checkpoint(self.dir)

    def test_index_names_missing_shard(self):
        with open(os.path.join(self.dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {}, "weight_map": {"a": "gone.safetensors"}}, f)
        with self.assertRaisesRegex(ref.RefError, "missing"):
            ref.Checkpoint(self.dir)

    def test_no_checkpoint(self):
        with self.assertRaisesRegex(ref.RefError, "no model.safetensors"):
            ref.Checkpoint(self.dir)


if __name__ == "__main__":
    unittest.main()
