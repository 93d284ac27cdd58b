#!/usr/bin/python3
"""The reference's whole forward pass on tiny checkpoints written by make_ref_model.py:
causality (rows at t do not depend on later tokens), the published visibility rules on the
traced top-k lists, config and token-map handling, and the command line's error paths."""

import json
import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import make_ref_model  # noqa: E402
import v41_ref as ref  # noqa: E402

PYTHON = "/usr/bin/python3"
T = 40


def write_json(path, doc):
    with open(path, "w") as f:
        json.dump(doc, f)


def ids_of(seed, n=T, vocab=512):
    return [int(v) for v in np.random.default_rng(seed).integers(0, vocab, n)]


class ModelCase(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        cls.plain = os.path.join(cls.tmp.name, "plain")
        cls.pert = os.path.join(cls.tmp.name, "perturbed")
        make_ref_model.make(cls.plain, seed=1, recipe="plain")
        make_ref_model.make(cls.pert, seed=2, recipe="perturbed", token_map="random")
        cls.models = {d: ref.Model(d) for d in (cls.plain, cls.pert)}

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def copy_model(self, src, name):
        dst = os.path.join(self.tmp.name, name)
        shutil.copytree(src, dst)
        return dst

    # --- causality and visibility -----------------------------------------------------------

    def test_rows_do_not_depend_on_later_tokens(self):
        a = ids_of(10)
        for cut in (1, 7, 17, 30):
            b = a[:cut] + ids_of(11 + cut, T - cut)
            self.assertNotEqual(a[cut:], b[cut:])
            for d, m in self.models.items():
                la, lb = m.forward(a), m.forward(b)
                self.assertTrue(np.array_equal(la[:cut], lb[:cut]), f"{d} cut {cut}")
                self.assertFalse(np.array_equal(la[cut:], lb[cut:]), f"{d} cut {cut}")

    def test_prefix_prefill_equals_rows_of_longer_prefill(self):
        a = ids_of(12)
        m = self.models[self.pert]
        full = m.forward(a)
        for n in (1, 2, 9, 25):
            self.assertTrue(np.array_equal(m.forward(a[:n]), full[:n]), f"prefix {n}")

    def test_topk_lists_follow_the_visibility_rules(self):
        m = self.models[self.pert]
        cfg = m.cfg
        tr = {}
        m.forward(ids_of(13), tr)
        for l in range(cfg.num_hidden_layers):
            r = cfg.ratios[l]
            if r == 0:
                self.assertNotIn(f"L{l}.topk", tr)
                continue
            topk = tr[f"L{l}.topk"]
            for t in range(T):
                n_vis = (t + 1) // r
                picks = topk[t][topk[t] >= 0]
                self.assertEqual(len(picks), min(cfg.index_topk, n_vis), f"layer {l} t {t}")
                self.assertTrue(np.all(picks < n_vis))
                self.assertTrue(np.all(np.diff(picks) > 0))
        # reuse layers publish their index source's list
        self.assertTrue(np.array_equal(tr["L3.topk"], tr["L2.topk"]))
        self.assertTrue(np.array_equal(tr["L7.topk"], tr["L6.topk"]))
        self.assertFalse(np.array_equal(tr["L6.topk"], tr["L5.topk"]))

    def test_logits_are_finite_and_in_range(self):
        for m in self.models.values():
            lg = m.forward(ids_of(14))
            self.assertEqual(lg.shape, (T, 512))
            self.assertEqual(lg.dtype, np.float32)
            self.assertTrue(np.all(np.isfinite(lg)))
            self.assertTrue(0.3 < float(lg.std()) < 3.0)

    # --- config and token map --------------------------------------------------------------

    def test_flat_config_equals_nested(self):
        d = self.copy_model(self.pert, "flat")
        path = os.path.join(d, "config.json")
        with open(path) as f:
            nested = json.load(f)
        flat = dict(nested["text_config"])
        flat["quantization_config"] = nested["quantization_config"]
        write_json(path, flat)
        a = ids_of(15)
        self.assertTrue(np.array_equal(ref.Model(d).forward(a), self.models[self.pert].forward(a)))

    def test_identity_map_file_equals_default(self):
        d = self.copy_model(self.plain, "mapped")
        write_json(os.path.join(d, "engram_token_map.json"),
                   {"vocab_size": 512, "compressed_vocab_size": 400, "pad_token_id": 2,
                    "map": [i % 400 for i in range(512)]})
        a = ids_of(16)
        self.assertTrue(np.array_equal(ref.Model(d).forward(a),
                                       self.models[self.plain].forward(a)))

    def test_token_map_changes_the_result(self):
        d = self.copy_model(self.plain, "remapped")
        write_json(os.path.join(d, "engram_token_map.json"),
                   {"vocab_size": 512, "compressed_vocab_size": 400, "pad_token_id": 2,
                    "map": [(i * 7) % 400 for i in range(512)]})
        a = ids_of(17)
        self.assertFalse(np.array_equal(ref.Model(d).forward(a),
                                        self.models[self.plain].forward(a)))

    def test_bad_token_maps(self):
        d = self.copy_model(self.plain, "badmap")
        path = os.path.join(d, "engram_token_map.json")
        for doc, msg in [({"map": [0] * 10}, "vocab_size 512"),
                         ({"map": [400] * 512}, r"outside \[0, 400\)"),
                         ({"map": [0] * 512, "compressed_vocab_size": 9}, "compressed_vocab"),
                         ({"nomap": 1}, "unreadable")]:
            write_json(path, doc)
            self.assert_refused(d, msg)
        os.remove(path)
        open(os.path.join(d, "tokenizer.json"), "w").close()
        self.assert_refused(d, "has tokenizer.json")
        # tokenizer.json wins over a map file (MODEL.md's order), so both present is refused
        write_json(path, {"map": [i % 400 for i in range(512)]})
        self.assert_refused(d, "has tokenizer.json")
        # an explicit map is used as given
        other = os.path.join(self.tmp.name, "explicit_map.json")
        write_json(other, {"map": [(i * 7) % 400 for i in range(512)]})
        a = ids_of(19)
        self.assertFalse(np.array_equal(ref.Model(d, other).forward(a),
                                        self.models[self.plain].forward(a)))

    def assert_refused(self, d, msg):
        with self.assertRaisesRegex(ref.RefError, msg):
            ref.Model(d)

    def test_bad_configs(self):
        d = self.copy_model(self.plain, "badcfg")
        path = os.path.join(d, "config.json")
        with open(path) as f:
            good = json.load(f)
        edits = [
            (lambda c: c["text_config"].pop("head_dim"), "missing key head_dim"),
            (lambda c: c["text_config"].update(hidden_size=100), "hidden_size 100"),
            (lambda c: c["text_config"].update(compress_ratios=[0, 0, 2, 4, 2, 1, 1, 1]),
             "ratio 4"),
            (lambda c: c["text_config"].update(kv_source_layer_ids=[5]), "no KV source"),
            (lambda c: c["text_config"].update(candidate_topk_blocks=1), "candidate blocks"),
            (lambda c: c["text_config"].update(scoring_func="softmax"), "scoring_func"),
            (lambda c: c["text_config"].update(engram_num_embeddings=[7]),
             "primes of layer 1 sum to 290"),
            (lambda c: c["quantization_config"].update(expert_dtype="fp8"), "expert_dtype"),
        ]
        for edit, msg in edits:
            cfg = json.loads(json.dumps(good))
            edit(cfg)
            write_json(path, cfg)
            self.assert_refused(d, msg)

    def test_missing_tensor_in_index(self):
        d = self.copy_model(self.plain, "notensor")
        path = os.path.join(d, "model.safetensors.index.json")
        with open(path) as f:
            index = json.load(f)
        del index["weight_map"]["layers.5.attn.indexer.wk.weight"]
        write_json(path, index)
        self.assert_refused(d, "lacks tensor layers.5.attn.indexer.wk")

    def test_seeded_engram_table_is_refused(self):
        d = self.copy_model(self.plain, "seeded")
        path = os.path.join(d, "model.safetensors.index.json")
        with open(path) as f:
            index = json.load(f)
        del index["weight_map"]["layers.1.engram.embed.weight"]
        del index["weight_map"]["layers.1.engram.embed.scale"]
        write_json(path, index)
        self.assert_refused(d, "lacks tensor layers.1.engram.embed.weight")
        with open(os.path.join(d, "config.json")) as f:
            cfg = json.load(f)
        cfg["text_config"]["engram_table_seed"] = 7
        write_json(os.path.join(d, "config.json"), cfg)
        self.assert_refused(d, "seeded Engram tables")

    # --- command line ----------------------------------------------------------------------

    def run_cli(self, *args):
        return subprocess.run([PYTHON, os.path.join(HERE, "v41_ref.py"), *args],
                              capture_output=True, text=True, timeout=120)

    def test_cli_outputs(self):
        a = ids_of(18, 6)
        ids = ",".join(map(str, a))
        want = self.models[self.plain].forward(a)
        p = self.run_cli("--model", self.plain, "--ids", ids, "--json")
        self.assertEqual(p.returncode, 0, p.stderr)
        doc = json.loads(p.stdout)
        self.assertEqual(doc["ids"], a)
        self.assertTrue(np.array_equal(np.array(doc["logits"], dtype=np.float32), want))
        out = os.path.join(self.tmp.name, "l.npy")
        p = self.run_cli("--model", self.plain, "--ids", ids, "--out", out)
        self.assertEqual(p.returncode, 0, p.stderr)
        self.assertTrue(np.array_equal(np.load(out), want))
        p = self.run_cli("--help")
        self.assertEqual(p.returncode, 0)
        self.assertIn("--ids", p.stdout)

    def test_cli_errors(self):
        cases = [
            (["--model", self.plain, "--ids", "1,x"], "comma-separated integers"),
            (["--model", self.plain, "--ids", "1,512"], "outside [0, 512)"),
            (["--model", os.path.join(self.tmp.name, "none"), "--ids", "1"], "not a directory"),
            (["--model", self.tmp.name, "--ids", "1"], "config.json: unreadable"),
            (["--model", self.plain, "--ids", ","], "--ids is empty"),
        ]
        for args, msg in cases:
            p = self.run_cli(*args)
            self.assertEqual(p.returncode, 1, args)
            self.assertIn(msg, p.stderr)
            self.assertEqual(len(p.stderr.strip().splitlines()), 1, p.stderr)
        p = self.run_cli("--ids", "1")
        self.assertNotEqual(p.returncode, 0)
        self.assertIn("--model", p.stderr)


if __name__ == "__main__":
    unittest.main()
