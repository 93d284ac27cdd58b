#!/usr/bin/python3
"""make_ref_model.py: writes a random-weight checkpoint in the released format (MODEL.md §7).

The weights follow MODEL.md §5's recipe: Linear weights N(0, 1/fan_in) quantised to their
stored format (FP8 E4M3 with UE8M0 per 32x32, routed experts FP4 E2M1 packed low nibble first
with UE8M0 per 1x32), norm gains 1, attn_sink 0, gate bias 0, hc_fn N(0, 1e-4), hc_base 0,
hc_scale 1, Engram q/k weights 1. `--recipe perturbed` replaces the constants by random values
around them (norm gains, sinks, gate bias, hc base/scale, a larger hc_fn, Engram q/k weights),
so that a transposed mixing matrix, an ignored sink or bias, or a wrong gain shows up in the
logits.

The checkpoint: config.json (nested: text_config + quantization_config),
model.safetensors.index.json and two shards; with `--token-map random`, also
engram_token_map.json. The built-in config is MODEL.md §5's tiny geometry with dimensions >= 64;
`--config FILE` takes another (nested or flat, HF key names).

Usage: make_ref_model.py --out DIR [--seed N] [--recipe plain|perturbed]
                         [--config FILE] [--token-map identity|random]
"""

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import v41_ref as ref  # noqa: E402  (number formats and Engram primes)

TINY = {
    "vocab_size": 512, "hidden_size": 128, "num_hidden_layers": 8,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64,
    "qk_rope_head_dim": 16, "q_lora_rank": 64, "o_groups": 2, "o_lora_rank": 32,
    "sliding_window": 8,
    "compress_ratios": [0, 0, 2, 2, 2, 1, 1, 1, 0, 0, 0],
    "kv_source_layer_ids": [2, 5], "index_source_layer_ids": [2, 5, 6],
    "candidate_source_layer_id": 5, "candidate_topk_blocks": 3, "candidate_block_size": 2,
    "index_n_heads": 2, "index_head_dim": 32, "index_topk": 5,
    "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 65536},
    "max_position_embeddings": 1048576, "rms_norm_eps": 1e-20,
    "n_routed_experts": 8, "num_experts_per_tok": 2, "n_shared_experts": 1,
    "moe_intermediate_size": 64, "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc",
    "norm_topk_prob": True, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0,
    "hidden_act": "silu", "attention_bias": False,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "engram_layer_ids": [1], "engram_max_ngram_size": 3, "engram_n_heads": 2,
    "engram_head_dim": 32, "engram_vocab_size": 64, "engram_compressed_vocab_size": 400,
    "engram_pad_token_id": 2,
    "num_nextn_predict_layers": 3, "dspark_block_size": 4, "dspark_noise_token_id": 511,
    "dspark_target_layer_ids": [5, 6, 7], "dspark_markov_rank": 32,
    "dspark_n_routed_experts": 4, "dspark_num_experts_per_tok": 2,
}

QUANT = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
         "scale_fmt": "ue8m0", "expert_dtype": "fp4"}


# ---------------------------------------------------------------------------------------------
# Encoders: value arrays -> (safetensors dtype, raw bytes array)
# ---------------------------------------------------------------------------------------------

def enc_bf16(x):
    return "BF16", (ref.bf16(x).view(np.uint32) >> 16).astype("<u2")


def enc_f32(x):
    return "F32", np.asarray(x, dtype="<f4")


def enc_fp8_blocks(w):
    """FP8 weight, UE8M0 per 32x32 block (procedure D) -> (codes, scale bytes)."""
    out, inp = w.shape
    bo, bi = -(-out // 32), -(-inp // 32)
    pad = np.zeros((bo * 32, bi * 32))
    pad[:out, :inp] = w
    blocks = ref.f32(pad).reshape(bo, 32, bi, 32)
    a = np.maximum(np.abs(blocks).max(axis=(1, 3)), np.float32(1e-4))
    sb = ref.ue8m0_ceil(a * (np.float32(1) / np.float32(448)))
    s = ref.ue8m0_decode(sb)[:, None, :, None]
    q = ref.e4m3_round(np.clip(blocks / s, -448, 448)).reshape(bo * 32, bi * 32)[:out, :inp]
    return ("F8_E4M3", ref.e4m3_encode(q)), ("F8_E8M0", sb.astype(np.uint8))


def enc_fp8_rows(w):
    """FP8 rows with one UE8M0 scale per 32 of a row (Engram table)."""
    q, sb = ref.quant_a_parts(w)
    return ("F8_E4M3", ref.e4m3_encode(q.reshape(w.shape))), ("F8_E8M0", sb.astype(np.uint8))


def enc_fp4(w):
    """FP4 E2M1 per 1x32 (procedure B), two codes per byte, element 2i in the low nibble."""
    codes, sb = ref.quant_b_parts(w)
    codes = codes.reshape(w.shape).astype(np.uint8)
    packed = codes[:, 0::2] | (codes[:, 1::2] << 4)
    return ("I8", packed.astype(np.uint8)), ("F8_E8M0", sb.astype(np.uint8))


# ---------------------------------------------------------------------------------------------
# Tensor inventory (MODEL.md §7.2) with the §5 recipe
# ---------------------------------------------------------------------------------------------

class Writer:
    def __init__(self, cfg, rng, perturbed):
        self.c = cfg
        self.rng = rng
        self.perturbed = perturbed
        self.tensors = {}   # name -> (dtype, raw array)

    def _normal(self, shape, std):
        return self.rng.standard_normal(shape) * std

    def linear(self, name, out, inp, kind="fp8"):
        w = self._normal((out, inp), 1.0 / np.sqrt(inp))
        if kind == "bf16":
            self.tensors[name + ".weight"] = enc_bf16(w)
            return
        wq, sc = enc_fp8_blocks(w) if kind == "fp8" else enc_fp4(w)
        self.tensors[name + ".weight"] = wq
        self.tensors[name + ".scale"] = sc

    def gain(self, name, n):
        g = np.ones(n)
        if self.perturbed:
            g += self.rng.uniform(-0.2, 0.2, n)
        self.tensors[name] = enc_bf16(g)

    def f32_tensor(self, name, value):
        self.tensors[name] = enc_f32(value)

    def perturb(self, shape, std):
        return self._normal(shape, std) if self.perturbed else np.zeros(shape)

    def hc(self, p):
        c = self.c
        hc, D = c["hc_mult"], c["hidden_size"]
        mw = (2 + hc) * hc
        for site in ("attn", "ffn"):
            self.f32_tensor(f"{p}hc_{site}_fn",
                            self._normal((mw, hc * D), 1e-2 if self.perturbed else 1e-4))
            self.f32_tensor(f"{p}hc_{site}_base", self.perturb(mw, 1.0))
            scale = self.rng.uniform(0.5, 1.5, 3) if self.perturbed else np.ones(3)
            self.f32_tensor(f"{p}hc_{site}_scale", scale)

    def attention(self, p):
        c = self.c
        D, H, hd = c["hidden_size"], c["num_attention_heads"], c["head_dim"]
        qlr, G, olr = c["q_lora_rank"], c["o_groups"], c["o_lora_rank"]
        a = p + "attn."
        self.linear(a + "wq_a", qlr, D)
        self.gain(a + "q_norm.weight", qlr)
        self.linear(a + "wq_b", H * hd, qlr)
        self.linear(a + "wkv", hd, D)
        self.gain(a + "kv_norm.weight", hd)
        self.linear(a + "wo_a", G * olr, H * hd // G)
        self.linear(a + "wo_b", D, G * olr)
        self.f32_tensor(a + "attn_sink", self.perturb(H, 1.0))
        self.gain(p + "attn_norm.weight", D)
        self.gain(p + "ffn_norm.weight", D)

    def long_range(self, l, p):
        c = self.c
        D, hd = c["hidden_size"], c["head_dim"]
        ih, idim = c["index_n_heads"], c["index_head_dim"]
        a = p + "attn."
        if l in c["kv_source_layer_ids"]:
            self.linear(a + "compressor.wkv", hd, D, "bf16")
            if c["compress_ratios"][l] > 1:
                self.linear(a + "compressor.wgate", hd, D, "bf16")
            self.gain(a + "compressor.norm.weight", hd)
        if l in c["index_source_layer_ids"]:
            self.linear(a + "indexer.wq_b", ih * idim, c["q_lora_rank"])
            self.linear(a + "indexer.weights_proj", ih, D, "bf16")
            if l in c["kv_source_layer_ids"]:
                self.linear(a + "indexer.wk", idim, hd, "bf16")
                self.gain(a + "indexer.k_norm.weight", idim)

    def moe(self, p, n_experts):
        c = self.c
        D, I = c["hidden_size"], c["moe_intermediate_size"]
        f = p + "ffn."
        self.linear(f + "gate", n_experts, D, "bf16")
        self.f32_tensor(f + "gate.bias", self.perturb(n_experts, 0.1))
        self.f32_tensor(f + "gate.bias_vl", np.zeros(n_experts))
        for e in range(n_experts):
            self.linear(f"{f}experts.{e}.w1", I, D, "fp4")
            self.linear(f"{f}experts.{e}.w3", I, D, "fp4")
            self.linear(f"{f}experts.{e}.w2", D, I, "fp4")
        Is = c.get("n_shared_experts", 1) * I
        if Is:
            self.linear(f + "shared_experts.w1", Is, D)
            self.linear(f + "shared_experts.w3", Is, D)
            self.linear(f + "shared_experts.w2", D, Is)

    def engram(self, p, rows):
        c = self.c
        D, hc, ehd = c["hidden_size"], c["hc_mult"], c["engram_head_dim"]
        lookups = (c["engram_max_ngram_size"] - 1) * c["engram_n_heads"]
        e = p + "engram."
        wq, sc = enc_fp8_rows(self._normal((rows, ehd), 1.0))
        self.tensors[e + "embed.weight"], self.tensors[e + "embed.scale"] = wq, sc
        self.linear(e + "wkv", (hc + 1) * D, lookups * ehd)
        for name in ("q_weight", "k_weight"):
            w = np.ones((hc, D))
            if self.perturbed:
                w += self.rng.uniform(-0.2, 0.2, (hc, D))
            self.tensors[e + name] = enc_bf16(w)

    def draft(self):
        c = self.c
        D, V = c["hidden_size"], c["vocab_size"]
        n = c.get("num_nextn_predict_layers", 0)
        for s in range(n):
            p = f"mtp.{s}."
            self.attention(p)
            self.hc(p)
            self.moe(p, c["dspark_n_routed_experts"])
        if n:
            rank = c["dspark_markov_rank"]
            self.linear("mtp.0.main_proj", D, len(c["dspark_target_layer_ids"]) * D)
            self.gain("mtp.0.main_norm.weight", D)
            last = f"mtp.{n - 1}."
            self.gain(last + "norm.weight", D)
            self.tensors[last + "markov_head.embed.weight"] = enc_bf16(self._normal((V, rank), 1))
            self.linear(last + "markov_head.head", V, rank, "bf16")
            self.linear(last + "confidence_head.proj", 1, D + rank, "bf16")

    def build(self, engram_rows):
        c = self.c
        D, V = c["hidden_size"], c["vocab_size"]
        self.tensors["embed.weight"] = enc_bf16(self._normal((V, D), 1.0))
        for l in range(c["num_hidden_layers"]):
            p = f"layers.{l}."
            self.attention(p)
            self.long_range(l, p)
            self.hc(p)
            self.moe(p, c["n_routed_experts"])
            if l in c.get("engram_layer_ids", []):
                self.engram(p, engram_rows[l])
        self.draft()
        self.gain("norm.weight", D)
        self.linear("head", V, D, "bf16")


# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------

def write_safetensors(path, tensors):
    header, offset, chunks = {}, 0, []
    for name in sorted(tensors):
        dtype, arr = tensors[name]
        data = np.ascontiguousarray(arr).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(len(text).to_bytes(8, "little"))
        f.write(text)
        for data in chunks:
            f.write(data)
    return offset


def write_checkpoint(out_dir, text_cfg, tensors, token_map):
    os.makedirs(out_dir, exist_ok=True)
    config = {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41",
              "dtype": "bfloat16", "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2,
              "quantization_config": QUANT, "text_config": text_cfg}
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    names = sorted(tensors)
    shards = [n for n in names if n.startswith("layers.") or n.startswith("mtp.")], \
        [n for n in names if not (n.startswith("layers.") or n.startswith("mtp."))]
    weight_map, total = {}, 0
    for i, group in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        total += write_safetensors(os.path.join(out_dir, fname), {n: tensors[n] for n in group})
        weight_map.update({n: fname for n in group})
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    if token_map is not None:
        with open(os.path.join(out_dir, "engram_token_map.json"), "w") as f:
            json.dump(token_map, f)


def make(out_dir, seed=0, recipe="plain", text_cfg=None, token_map="identity"):
    """Writes the checkpoint; returns the text config used."""
    c = dict(text_cfg or TINY)
    ref.Config({"text_config": c, "quantization_config": QUANT})   # validate before writing
    rng = np.random.default_rng(seed)
    rows = {}
    if c.get("engram_layer_ids"):
        primes = ref.engram_primes(c["engram_vocab_size"], c["engram_layer_ids"],
                                   c["engram_max_ngram_size"], c["engram_n_heads"])
        rows = {l: sum(sum(o) for o in primes[l]) for l in c["engram_layer_ids"]}
        c["engram_num_embeddings"] = [rows[l] for l in c["engram_layer_ids"]]
    w = Writer(c, rng, recipe == "perturbed")
    w.build(rows)
    tmap = None
    if token_map == "random" and c.get("engram_layer_ids"):
        cvs, pad = c["engram_compressed_vocab_size"], c.get("engram_pad_token_id", 2)
        m = rng.integers(0, cvs, size=c["vocab_size"])
        m[pad] = pad % cvs
        tmap = {"vocab_size": c["vocab_size"], "compressed_vocab_size": cvs,
                "pad_token_id": pad, "map": [int(v) for v in m]}
    write_checkpoint(out_dir, c, w.tensors, tmap)
    return c


def main(argv=None):
    ap = argparse.ArgumentParser(prog="make_ref_model.py",
                                 description="Write a random-weight V4.1 checkpoint in the "
                                             "released format (MODEL.md §5, §7).")
    ap.add_argument("--out", required=True, help="output directory (created)")
    ap.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    ap.add_argument("--recipe", choices=("plain", "perturbed"), default="plain",
                    help="plain: MODEL.md §5 recipe; perturbed: random gains, sinks, biases, "
                         "mixing parameters")
    ap.add_argument("--config", help="config.json to use (nested or flat, HF keys); default: "
                                     "the built-in tiny config")
    ap.add_argument("--token-map", choices=("identity", "random"), default="identity",
                    help="identity: no engram_token_map.json (the default map); random: write "
                         "a random map")
    args = ap.parse_args(argv)
    try:
        text = None
        if args.config:
            with open(args.config) as f:
                raw = json.load(f)
            text = raw.get("text_config", raw)
        make(args.out, args.seed, args.recipe, text, args.token_map)
    except (ref.RefError, OSError, ValueError, KeyError) as e:
        print(f"make_ref_model.py: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
