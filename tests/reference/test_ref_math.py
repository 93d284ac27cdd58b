#!/usr/bin/python3
"""Pieces of the reference's model math against MODEL.md's published numbers and hand cases:
Engram primes, multipliers and hashes, YaRN bounds, RoPE pairing, Sinkhorn, mHC at the §5
recipe, RMSNorm of zeros, window and compressed visibility, top-k and candidate blocks."""

import math
import os
from decimal import Decimal, getcontext
import sys
import types
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import v41_ref as ref  # noqa: E402

# MODEL.md §2.9, full geometry
PRIMES = {
    1: [[16000057, 16000079, 16000081, 16000097, 16000121, 16000129, 16000133, 16000183],
        [16000189, 16000207, 16000211, 16000253, 16000277, 16000289, 16000307, 16000321],
        [16000339, 16000381, 16000393, 16000399, 16000403, 16000409, 16000447, 16000463]],
    14: [[16000477, 16000487, 16000499, 16000507, 16000511, 16000573, 16000609, 16000627],
         [16000667, 16000669, 16000693, 16000697, 16000711, 16000729, 16000759, 16000769],
         [16000781, 16000799, 16000813, 16000819, 16000841, 16000877, 16000879, 16000889]],
}
MULTIPLIERS = {
    1: [76632096046245, 4839876093313, 35959672319349, 73987337458391],
    14: [67716810739261, 51510806800915, 30921347202721, 82619226485591],
}


class Engram(unittest.TestCase):
    def test_full_geometry_primes(self):
        primes = ref.engram_primes(16000000, [1, 14], 4, 8)
        self.assertEqual(primes, PRIMES)
        self.assertEqual(sum(map(sum, primes[1])), 384006168)
        self.assertEqual(sum(map(sum, primes[14])), 384016682)

    def test_per_order_vocab_list(self):
        # one start per n-gram order: 2-grams from 10, 3-grams from 20
        self.assertEqual(ref.engram_primes([10, 20], [3], 3, 2), {3: [[11, 13], [23, 29]]})

    def test_multipliers(self):
        for layer, want in MULTIPLIERS.items():
            self.assertEqual(ref.engram_multipliers(layer, 99092, 4), want)

    def test_hash_rolling_xor_and_sticky_pad(self):
        cfg = types.SimpleNamespace(engram_max_ngram_size=3, engram_n_heads=2,
                                    engram_layer_ids=[1], engram_compressed_vocab_size=99092)
        primes = {1: [[101, 103], [107, 109]]}
        cmap = np.arange(1000) % 99092
        cmap[7] = 70                        # a non-identity entry
        pad = 2
        got = ref.engram_hash_ids([5, 7, 9], cfg, cmap, pad, primes)[1]
        M = MULTIPLIERS[1]
        offsets = [0, 101, 204, 311]
        toks = [[5, pad, pad], [70, 5, pad], [9, 70, 5]]   # cid(p - s), pad before position 0
        for p, (t0, t1, t2) in enumerate(toks):
            r2 = (t0 * M[0]) ^ (t1 * M[1])
            r3 = r2 ^ (t2 * M[2])
            want = [r2 % 101, r2 % 103 + 101, r3 % 107 + 204, r3 % 109 + 311]
            self.assertEqual(list(got[p]), want, f"position {p}")
            self.assertEqual([w - o for w, o in zip(want, offsets)],
                             [r2 % 101, r2 % 103, r3 % 107, r3 % 109])

    def test_default_map_is_identity_modulo(self):
        cfg = types.SimpleNamespace(engram_compressed_vocab_size=5, engram_pad_token_id=2,
                                    vocab_size=12)
        cmap, pad = ref.load_token_map("/nonexistent-dir", cfg)
        self.assertEqual(list(cmap), [0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 0, 1])
        self.assertEqual(pad, 2)


def taylor_sin(x):
    """sin(x) to ~50 digits with decimal arithmetic, rounded to a float at the end."""
    getcontext().prec = 60
    pi = Decimal("3.14159265358979323846264338327950288419716939937510582097494459")
    d = Decimal(x)
    d -= (d / (2 * pi)).to_integral_value() * 2 * pi
    total, term, n = Decimal(0), d, 1
    while abs(term) > Decimal("1e-55"):
        total += term
        term = -term * d * d / ((n + 1) * (n + 2))
        n += 2
    return float(total)


class Rope(unittest.TestCase):
    def test_yarn_bounds(self):
        self.assertEqual(ref.yarn_bounds(64, 160000, 65536, 32, 1), (15, 25))

    def cfg(self):
        return types.SimpleNamespace(qk_rope_head_dim=64, rope_theta=10000.0,
                                     compress_rope_theta=160000.0,
                                     rope_scaling={"type": "yarn", "factor": 16, "beta_fast": 32,
                                                   "beta_slow": 1,
                                                   "original_max_position_embeddings": 65536})

    def test_yarn_frequencies(self):
        f, bounds = ref.rope_freqs(self.cfg(), 2)
        self.assertEqual(bounds, (15, 25))
        for i in range(32):
            base = np.float32(160000.0 ** (-2 * i / 64))
            if i <= 15:
                self.assertEqual(f[i], base, i)
            elif i >= 25:
                self.assertAlmostEqual(float(f[i]), float(base) / 16, delta=float(base) * 1e-6)
            else:
                self.assertTrue(float(base) / 16 < f[i] < base, i)

    def test_ratio_zero_has_no_yarn(self):
        f, bounds = ref.rope_freqs(self.cfg(), 0)
        self.assertIsNone(bounds)
        self.assertEqual(f[31], np.float32(10000.0 ** (-62 / 64)))

    def test_table_is_correctly_rounded(self):
        # position 87, f = fp32(0.2236068): the fp32 angle is 19.45379; its sine, to 50 digits,
        # lies 0.09 fp32 ulp below the midpoint of 0.56813246 and 0.5681325 (a float32 sine
        # kernel returns the upper one)
        f = np.array([0.2236068], dtype=np.float32)
        cos, sin = ref.rope_table(np.array([87]), f)
        angle = np.float32(87.0 * float(f[0]))
        self.assertEqual(sin[0, 0], np.float32(taylor_sin(float(angle))))
        self.assertEqual(sin[0, 0], np.float32(0.56813246))
        self.assertEqual(cos[0, 0], np.float32(taylor_sin(float(angle) + math.pi / 2)))

    def test_adjacent_pairs_on_the_last_numbers(self):
        # 8 numbers, rope dim 4: pairs (4, 5) and (6, 7) rotate, 0..3 stay
        x = np.array([[[1, 2, 3, 4, 1, 0, 0, 1]]], dtype=np.float32)
        freqs = np.array([0.5, 0.25], dtype=np.float32)
        y = ref.rope(x, np.array([2]), freqs)[0, 0]
        self.assertEqual(list(y[:4]), [1, 2, 3, 4])
        c1, s1, c2, s2 = math.cos(1.0), math.sin(1.0), math.cos(0.5), math.sin(0.5)
        want = [c1, s1, -s2, c2]              # (1, 0) -> (cos, sin); (0, 1) -> (-sin, cos)
        for got, w in zip(y[4:], want):
            self.assertAlmostEqual(float(got), w, delta=abs(w) * 2 ** -8)
        back = ref.rope(y[None, None, :], np.array([2]), freqs, inverse=True)[0, 0]
        for got, w in zip(back[4:], [1, 0, 0, 1]):
            self.assertAlmostEqual(float(got), w, delta=2 ** -7)


class Mhc(unittest.TestCase):
    def test_sinkhorn_columns_sum_to_one(self):
        Z = np.random.default_rng(3).normal(0, 2, (5, 4, 4))
        S = ref.sinkhorn(Z, 20, 1e-6)
        self.assertTrue(np.all(np.abs(S.sum(axis=1) - 1) < 1e-5))       # columns
        self.assertTrue(np.all(np.abs(S.sum(axis=2) - 1) < 1e-2))       # rows, nearly
        self.assertTrue(np.all(S > 0))

    def test_sinkhorn_single_iteration_is_softmax_then_columns(self):
        Z = np.array([[0.0, math.log(3.0)], [0.0, 0.0]])
        S = ref.sinkhorn(Z, 1, 0.0)
        # row softmax [[1/4, 3/4], [1/2, 1/2]], then columns divided by 3/4 and 5/4
        want = [[1 / 3, 3 / 5], [2 / 3, 2 / 5]]
        self.assertTrue(np.allclose(S, want, rtol=1e-6))

    def cfg(self):
        return types.SimpleNamespace(rms_norm_eps=1e-20, hc_eps=1e-6, hc_sinkhorn_iters=20)

    def test_recipe_values(self):
        # MODEL.md §5: hc_fn = 0, base 0, scale 1 -> pre 0.5 + 1e-6, post 1, comb 1/4
        H = np.random.default_rng(4).normal(size=(3, 4, 64)).astype(np.float32)
        pre, post, comb = ref.hc_mixes(H, np.zeros((24, 256)), np.zeros(24), np.ones(3),
                                       self.cfg())
        self.assertTrue(np.allclose(pre, 0.5 + 1e-6, rtol=0, atol=1e-7))
        self.assertTrue(np.allclose(post, 1.0, rtol=0, atol=1e-7))
        self.assertTrue(np.allclose(comb, 0.25, rtol=0, atol=1e-6))

    def test_mix_layout_and_comb_transpose(self):
        # fn = 0, so the mixes are sigmoid/softmax of the bases alone
        base = np.zeros(24)
        base[0], base[5] = 2.0, -1.0            # pre_0 and post_1
        H = np.ones((1, 4, 32), dtype=np.float32)
        pre, post, comb = ref.hc_mixes(H, np.zeros((24, 128)), base, np.ones(3), self.cfg())
        self.assertAlmostEqual(float(pre[0, 0]), 1 / (1 + math.exp(-2)) + 1e-6, places=6)
        self.assertAlmostEqual(float(post[0, 1]), 2 / (1 + math.exp(1)), places=6)
        # expand: copy j takes column j of comb
        comb = np.zeros((1, 4, 4), dtype=np.float32)
        comb[0, 2, 0] = 1.0                      # copy 0 <- copy 2
        Hs = np.arange(4, dtype=np.float32)[None, :, None] * np.ones((1, 4, 32), np.float32)
        out = ref.hc_expand(Hs, np.zeros((1, 32), np.float32), np.zeros((1, 4), np.float32),
                            comb)
        self.assertEqual(float(out[0, 0, 0]), 2.0)
        self.assertEqual(float(out[0, 2, 0]), 0.0)


class Norm(unittest.TestCase):
    def test_all_zero_input_gives_zero(self):
        y = ref.rmsnorm(np.zeros((2, 64), dtype=np.float32), np.ones(64), 1e-20)
        self.assertFalse(np.any(np.isnan(y)))
        self.assertTrue(np.all(y == 0))

    def test_scale_and_bf16_output(self):
        x = np.full((1, 32), 3.0, dtype=np.float32)
        y = ref.rmsnorm(x, np.full(32, 1.5), 1e-20)
        self.assertTrue(np.all(y == 1.5))


class Visibility(unittest.TestCase):
    def test_window(self):
        self.assertEqual(list(ref.window_positions(0, 4)), [0])
        self.assertEqual(list(ref.window_positions(2, 4)), [0, 1, 2])
        self.assertEqual(list(ref.window_positions(5, 4)), [2, 3, 4, 5])

    def test_compressed(self):
        # ratio 2: entry j covers tokens 2j, 2j+1 and is visible once 2j+1 is processed
        self.assertEqual([ref.n_visible(p, 2) for p in range(6)], [0, 1, 1, 2, 2, 3])
        # ratio 1: one entry per token, including the token itself
        self.assertEqual([ref.n_visible(p, 1) for p in range(4)], [1, 2, 3, 4])

    def test_topk_ties_order_and_fillers(self):
        self.assertEqual(list(ref.topk_ascending(np.array([1, 3, 3, 2, -np.inf]), 3)),
                         [1, 2, 3])
        self.assertEqual(list(ref.topk_ascending(np.array([1.0, 5, 1, 1]), 2)), [0, 1])
        self.assertEqual(list(ref.topk_ascending(np.array([2.0, 2, 2]), 2)), [0, 1])
        self.assertEqual(list(ref.topk_ascending(np.array([-np.inf, 2, -np.inf]), 2)), [-1, 1])
        self.assertEqual(list(ref.topk_ascending(np.array([4.0, 1, 9]), 0)), [])

    def test_candidate_blocks(self):
        # 8 entries in blocks of 2, 7 visible: the block of entry 6 is pinned
        s = np.array([1, 9, 2, 3, 5, 0, 4, -np.inf])
        mask = ref.candidate_mask(s, 7, 2, 2)
        self.assertEqual(list(np.nonzero(mask)[0]), [0, 1, 6, 7])
        # tie between blocks 0 and 1 goes to the lower block
        s = np.array([4, 0, 4, 1, 1, 1, 0, 0])
        self.assertEqual(list(np.nonzero(ref.candidate_mask(s, 8, 2, 2))[0]), [0, 1, 6, 7])
        # -inf blocks are dropped even when there is room for them
        s = np.array([1, 2] + [-np.inf] * 6)
        self.assertEqual(list(np.nonzero(ref.candidate_mask(s, 2, 2, 3))[0]), [0, 1])
        self.assertFalse(np.any(ref.candidate_mask(np.full(4, -np.inf), 0, 2, 3)))


if __name__ == "__main__":
    unittest.main()
