#!/usr/bin/python3
"""The reference reads checkpoints written by di-mkmodel (the shipped tiny config): format,
config, token map and tables are understood, the logits are finite and causal.

Usage: test_ref_mkmodel.py DI_MKMODEL"""

import json
import os
import subprocess
import sys
import tempfile
import unittest

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import v41_ref as ref  # noqa: E402

MKMODEL = None


class FromMkmodel(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.dir = os.path.join(cls.tmp.name, "tiny")
        p = subprocess.run([MKMODEL, "--quiet", "--seed", "3", "tiny", cls.dir],
                           capture_output=True, text=True, timeout=120)
        if p.returncode != 0:
            raise RuntimeError(f"di-mkmodel failed: {p.stderr.strip()}")
        cls.model = ref.Model(cls.dir)

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_token_map_is_read(self):
        with open(os.path.join(self.dir, "engram_token_map.json")) as f:
            doc = json.load(f)
        self.assertEqual(list(self.model.cmap), doc["map"])
        self.assertEqual(self.model.cpad, doc["map"][doc["pad_token_id"]])

    def test_logits_finite_and_causal(self):
        cfg = self.model.cfg
        rng = np.random.default_rng(5)
        a = [int(v) for v in rng.integers(3, cfg.vocab_size, 150)]
        b = a[:100] + [int(v) for v in rng.integers(3, cfg.vocab_size, 50)]
        la, lb = self.model.forward(a), self.model.forward(b)
        self.assertEqual(la.shape, (150, cfg.vocab_size))
        self.assertTrue(np.all(np.isfinite(la)))
        self.assertTrue(0.3 < float(la.std()) < 3.0)
        self.assertTrue(np.array_equal(la[:100], lb[:100]))
        self.assertFalse(np.array_equal(la[100:], lb[100:]))


if __name__ == "__main__":
    if len(sys.argv) < 2 or not os.access(sys.argv[1], os.X_OK):
        print("usage: test_ref_mkmodel.py DI_MKMODEL", file=sys.stderr)
        sys.exit(2)
    MKMODEL = sys.argv.pop(1)
    unittest.main()
