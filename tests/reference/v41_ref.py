#!/usr/bin/python3
"""v41_ref.py: an independent NumPy reference of the DeepSeek-V4.1 forward pass.

Written from docs/MODEL.md (sections 1-3 and 7) alone, as the oracle the C forward pass is
checked against. It reads a checkpoint directory in the released format (MODEL.md §7), runs a
prefill over a token sequence starting at position 0 and returns the fp32 logits of every
position. Decode logits at position t equal prefill logits at t (MODEL.md: "decode equals
prefill"), so the rows of the prefill serve for decode as well.

Usage:
    v41_ref.py --model DIR --ids 1,2,3 [--out FILE.npy | --json] [--trace FILE.npz]

Runs with /usr/bin/python3 and NumPy 1.24, nothing else. Small configs only (dimensions in
the hundreds, a few hundred tokens).

Arithmetic conventions (where MODEL.md says "fp32"):
  * every fp32 result is the exactly rounded fp32 value: it is computed in double precision
    and rounded once to fp32 where it is stored (`f32`). A dot product or sum is computed in
    double and rounded once: an fp32 accumulation in any order differs from it only by fp32
    rounding error;
  * BF16 storage points round the fp32 value to nearest even (`bf16`), exactly where
    MODEL.md stores bf16: the residual stream, norm outputs, Linear outputs, RoPE write-back,
    attention output, MoE output;
  * FP8 / FP4 fake quantisation follows §3.2 procedures (A), (B), (C) bit for bit, including
    the fp32 evaluation of a * (1/448), a / 6 and x / s;
  * exp, log1p, sin and cos come from the C library (Python's math), element by element, so
    the results do not depend on NumPy's SIMD code paths.

Choices where MODEL.md leaves room (each is listed in tests/reference/README.md):
  * Engram compressed-token map: engram_token_map.json in the model directory when present,
    else the identity map modulo engram_compressed_vocab_size. The compressed pad id is
    map[pad_token_id]. A model directory with tokenizer.json (from which MODEL.md builds the
    map first) is refused unless --token-map names the map to use.
  * Routed-expert and shared-expert W1/W3 outputs are rounded to bf16 (the §2.2 rule for every
    quantised Linear) before being taken as fp32 for the clamp and SwiGLU.
  * Attention probabilities stay fp32 before the product with V; the head output is rounded
    to bf16 once.
  * Indexer scores are computed in fp32 (q.k dots, ReLU, weighted head sum) and rounded to
    bf16 once before top-k; the head weights are the bf16 weights_proj output times
    fp32(index_head_dim^-0.5 * index_n_heads^-0.5), an fp32 product.
  * Top-k and candidate-block ties go to the lower index; MoE routing ties to the lower
    expert id. A top-k pick whose score is -inf is published as -1.
  * The mHC mixes GEMM (fn @ v) is fp32 (not TF32).
"""

import argparse
import json
import math
import os
import struct
import sys

import numpy as np

F64 = np.float64
F32 = np.float32


class RefError(Exception):
    """A bad input (checkpoint, config, ids): reported as one line by the CLI."""


# ---------------------------------------------------------------------------------------------
# Element formats (MODEL.md §3.1)
# ---------------------------------------------------------------------------------------------

def f32(x):
    """x rounded to fp32 (round to nearest even), as an fp32 array."""
    return np.asarray(x, dtype=F64).astype(F32)


def bf16(x):
    """x rounded to the nearest BF16 value (ties to even), returned as fp32 values."""
    u = np.ascontiguousarray(f32(x)).view(np.uint32).astype(np.uint64)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
    r = np.where(nan, (u | 0x00400000) & 0xFFFF0000, r)
    return r.astype(np.uint32).view(F32)


E4M3_MAX = 448.0


def e4m3_decode(codes):
    """E4M3 (e4m3fn) codes -> float64 values. S.1111.111 is NaN; no infinity."""
    c = np.asarray(codes, dtype=np.uint8).astype(np.int64)
    sign = np.where(c & 0x80, -1.0, 1.0)
    e = (c >> 3) & 0xF
    m = c & 0x7
    mag = np.where(e == 0, m * 2.0 ** -9, np.ldexp(1.0 + m / 8.0, e - 7))
    mag = np.where((e == 15) & (m == 7), np.nan, mag)
    return sign * mag


def e4m3_round(x):
    """x clamped to [-448, 448] and rounded to the nearest E4M3 value (ties to even)."""
    v = np.clip(np.asarray(x, dtype=F64), -E4M3_MAX, E4M3_MAX)
    a = np.abs(v)
    _, e = np.frexp(a)                      # a = m * 2^e, m in [0.5, 1)
    exp = np.maximum(e - 1, -6)             # subnormals share the quantum of 2^-6
    quantum = np.ldexp(1.0, exp - 3)       # 3 mantissa bits
    r = np.rint(a / quantum) * quantum      # rint: round half to even
    return np.copysign(r, v)


_E4M3_POS = e4m3_decode(np.arange(0, 127, dtype=np.uint8))  # codes 0..126, ascending


def e4m3_encode(x):
    """Values already on the E4M3 grid (|x| <= 448) -> codes; the sign goes to bit 7."""
    v = np.asarray(x, dtype=F64)
    code = np.searchsorted(_E4M3_POS, np.abs(v))
    if not np.array_equal(_E4M3_POS[np.minimum(code, 126)], np.abs(v)):
        raise ValueError("e4m3_encode: value not on the E4M3 grid")
    return (code | np.where(v < 0, 0x80, 0)).astype(np.uint8)


def ue8m0_decode(codes):
    """UE8M0 bytes -> 2^(e-127); 0xFF is NaN."""
    e = np.asarray(codes, dtype=np.uint8).astype(np.int64)
    return np.where(e == 255, np.nan, np.ldexp(1.0, e - 127))


def ue8m0_ceil(y):
    """UE8M0 byte of 2^ceil(log2(y)) for positive normal fp32 y, from its bits: the exponent
    field, plus one when the mantissa is not zero."""
    bits = np.ascontiguousarray(f32(y)).view(np.uint32).astype(np.int64)
    return ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0)


E2M1_VALUES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
_E2M1_MIDS = (E2M1_VALUES[:-1] + E2M1_VALUES[1:]) / 2


def e2m1_codes(x):
    """x (already in [-6, 6]) -> 4-bit E2M1 codes: nearest, ties to the even code, sign in bit 3
    for x < 0."""
    v = np.asarray(x, dtype=F64)
    a = np.abs(v)
    code = np.zeros(a.shape, dtype=np.int64)
    for k, mid in enumerate(_E2M1_MIDS):     # mid between code k and code k + 1
        code += a > mid
        if k % 2 == 1:                       # a tie between odd k and even k + 1 goes up
            code += a == mid
    return code | np.where(v < 0, 8, 0)


def e2m1_decode(codes):
    c = np.asarray(codes, dtype=np.int64)
    return np.where(c & 8, -1.0, 1.0) * E2M1_VALUES[c & 7]


def e2m1_round(x):
    return e2m1_decode(e2m1_codes(x))


# ---------------------------------------------------------------------------------------------
# Quantisation procedures (MODEL.md §3.2). Each works on blocks along the last axis and returns
# the dequantised values (fake quantisation) as fp32; the *_parts variants also return codes and
# scales for the checkpoint writer.
# ---------------------------------------------------------------------------------------------

def _blocks(x, block):
    x = f32(x)
    if x.shape[-1] % block:
        raise RefError(f"width {x.shape[-1]} is not a multiple of the block {block}")
    return x.reshape(x.shape[:-1] + (x.shape[-1] // block, block))


def quant_a_parts(x):
    """(A) FP8 E4M3, block 32, UE8M0 scale. Returns (values [.., nb, 32], scale bytes [.., nb])."""
    xb = _blocks(x, 32)
    a = np.maximum(np.abs(xb).max(-1), F32(1e-4))
    y = a * (F32(1) / F32(448))                         # fp32 product, as in the kernel
    sb = ue8m0_ceil(y)
    s = ue8m0_decode(sb)[..., None]
    q = e4m3_round(np.clip(xb / s, -E4M3_MAX, E4M3_MAX))  # x / s is exact: s is 2^k
    return q, sb


def quant_a(x):
    q, sb = quant_a_parts(x)
    return f32((q * ue8m0_decode(sb)[..., None]).reshape(np.shape(x)))


def quant_b_parts(x):
    """(B) FP4 E2M1, block 32, UE8M0 scale. Returns (codes [.., nb, 32], scale bytes [.., nb])."""
    xb = _blocks(x, 32)
    a = np.maximum(np.abs(xb).max(-1), F32(6.0 * 2.0 ** -126))
    sb = ue8m0_ceil(a / F32(6))
    s = ue8m0_decode(sb)[..., None]
    return e2m1_codes(np.clip(xb / s, -6.0, 6.0)), sb


def quant_b(x):
    codes, sb = quant_b_parts(x)
    return f32((e2m1_decode(codes) * ue8m0_decode(sb)[..., None]).reshape(np.shape(x)))


def quant_c(x):
    """(C) FP4 E2M1, block 16, E4M3 scale (used as its fp32 value); x / s is an fp32 division."""
    xb = _blocks(x, 16)
    a = np.maximum(np.abs(xb).max(-1), F32(6.0 * 2.0 ** -9))
    s = f32(e4m3_round(a / F32(6)))[..., None]
    q = e2m1_round(np.clip(xb / s, F32(-6), F32(6)))     # fp32 / fp32 -> fp32
    return f32((q * s).reshape(np.shape(x)))


# ---------------------------------------------------------------------------------------------
# Safetensors and the checkpoint directory (MODEL.md §7)
# ---------------------------------------------------------------------------------------------

# dtype name -> bytes per element
SAFE_DTYPES = {"F32": 4, "BF16": 2, "F8_E4M3": 1, "F8_E8M0": 1, "I8": 1}


class SafetensorsFile:
    """One shard: 8-byte little-endian header length, JSON header, raw little-endian data."""

    def __init__(self, path):
        self.path = path
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise RefError(f"{path}: shorter than the 8-byte header length")
            (n,) = struct.unpack("<Q", head)
            if n > size - 8:
                raise RefError(f"{path}: header length {n} runs past the end of the file")
            try:
                header = json.loads(f.read(n).decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise RefError(f"{path}: bad JSON header: {e}") from None
        if not isinstance(header, dict):
            raise RefError(f"{path}: header is not a JSON object")
        self.data_start = 8 + n
        self.tensors = {}
        for name, info in header.items():
            if name == "__metadata__":
                continue
            self.tensors[name] = self._check_entry(name, info, size - self.data_start)

    def _check_entry(self, name, info, data_size):
        try:
            dtype, shape, (b, e) = info["dtype"], list(info["shape"]), info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise RefError(f"{self.path}: tensor {name}: malformed header entry") from None
        if dtype not in SAFE_DTYPES:
            raise RefError(f"{self.path}: tensor {name}: unsupported dtype {dtype}")
        if not all(isinstance(d, int) and d >= 0 for d in shape):
            raise RefError(f"{self.path}: tensor {name}: bad shape {shape}")
        nbytes = int(np.prod(shape, dtype=np.int64)) * SAFE_DTYPES[dtype]
        if not (isinstance(b, int) and isinstance(e, int) and 0 <= b <= e <= data_size
                and e - b == nbytes):
            raise RefError(f"{self.path}: tensor {name}: data_offsets [{b}, {e}] do not hold "
                           f"{nbytes} bytes of {dtype}{shape} inside the data section")
        return dtype, shape, b

    def raw(self, name):
        """(dtype, shape, raw array): F32 -> float32, BF16 -> uint16, others -> uint8."""
        dtype, shape, b = self.tensors[name]
        np_type = {"F32": "<f4", "BF16": "<u2"}.get(dtype, "u1")
        count = int(np.prod(shape, dtype=np.int64))
        arr = np.fromfile(self.path, dtype=np_type, count=count,
                          offset=self.data_start + b)
        return dtype, shape, arr.reshape(shape)


def _plain_values(dtype, raw):
    if dtype == "F32":
        return raw.astype(F64)
    if dtype == "BF16":
        return (raw.astype(np.uint32) << 16).view(F32).astype(F64)
    raise AssertionError(dtype)


class Checkpoint:
    """The tensors of a model directory, read through model.safetensors.index.json (or a single
    model.safetensors). Accessors check dtype and shape and return float64 arrays holding the
    exact dequantised values."""

    def __init__(self, model_dir):
        self.dir = model_dir
        index = os.path.join(model_dir, "model.safetensors.index.json")
        single = os.path.join(model_dir, "model.safetensors")
        self.where = {}
        self.files = {}
        if os.path.exists(index):
            try:
                with open(index) as f:
                    weight_map = json.load(f)["weight_map"]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise RefError(f"{index}: unreadable index ({e})") from None
            for name, shard in weight_map.items():
                self.where[name] = self._open(shard)
        elif os.path.exists(single):
            shard = self._open("model.safetensors")
            for name in shard.tensors:
                self.where[name] = shard
        else:
            raise RefError(f"{model_dir}: no model.safetensors.index.json or model.safetensors")
        for name, shard in self.where.items():
            if name not in shard.tensors:
                raise RefError(f"{shard.path}: index names tensor {name} but the shard lacks it")

    def _open(self, shard):
        if shard not in self.files:
            path = os.path.join(self.dir, shard)
            if not os.path.exists(path):
                raise RefError(f"{path}: shard named by the index is missing")
            self.files[shard] = SafetensorsFile(path)
        return self.files[shard]

    def has(self, name):
        return name in self.where

    def _raw(self, name, dtypes, shape):
        if name not in self.where:
            raise RefError(f"checkpoint lacks tensor {name}")
        dtype, got, raw = self.where[name].raw(name)
        if dtype not in dtypes:
            raise RefError(f"tensor {name}: dtype {dtype}, expected {' or '.join(dtypes)}")
        if shape is not None and list(got) != list(shape):
            raise RefError(f"tensor {name}: shape {got}, expected {list(shape)}")
        return dtype, raw

    def plain(self, name, shape):
        """A BF16 or F32 tensor."""
        dtype, raw = self._raw(name, ("BF16", "F32"), shape)
        return _plain_values(dtype, raw)

    def fp8(self, name, shape):
        """F8_E4M3 [out, in] with a `.scale` sibling, UE8M0 per 32x32 block."""
        w = e4m3_decode(self._raw(name, ("F8_E4M3",), shape)[1])
        sname = name[: -len(".weight")] + ".scale"
        out, inp = shape
        s = ue8m0_decode(self._raw(sname, ("F8_E8M0",), [-(-out // 32), -(-inp // 32)])[1])
        s = np.repeat(np.repeat(s, 32, axis=0), 32, axis=1)[:out, :inp]
        return w * s

    def fp8_rows(self, name, shape):
        """F8_E4M3 [rows, width] with a UE8M0 scale per 32 of a row (the Engram table)."""
        w = e4m3_decode(self._raw(name, ("F8_E4M3",), shape)[1])
        rows, width = shape
        sname = name[: -len(".weight")] + ".scale"
        s = ue8m0_decode(self._raw(sname, ("F8_E8M0",), [rows, width // 32])[1])
        return w * np.repeat(s, 32, axis=1)

    def fp4(self, name, shape):
        """I8 [out, in/2], two E2M1 codes per byte (element 2i in the low nibble), with a UE8M0
        scale per 1x32 along the input."""
        out, inp = shape
        b = self._raw(name, ("I8",), [out, inp // 2])[1]
        codes = np.empty((out, inp), dtype=np.int64)
        codes[:, 0::2] = b & 0x0F
        codes[:, 1::2] = b >> 4
        sname = name[: -len(".weight")] + ".scale"
        s = ue8m0_decode(self._raw(sname, ("F8_E8M0",), [out, inp // 32])[1])
        return e2m1_decode(codes) * np.repeat(s, 32, axis=1)


# ---------------------------------------------------------------------------------------------
# Configuration (MODEL.md §0, §7.3): HF key names, nested text_config or flat
# ---------------------------------------------------------------------------------------------

REQUIRED = object()

# HF key, default (REQUIRED if none). Keys of the draft (dspark_*) and vision are not read.
CONFIG_KEYS = [
    ("vocab_size", REQUIRED), ("hidden_size", REQUIRED), ("num_hidden_layers", REQUIRED),
    ("num_attention_heads", REQUIRED), ("head_dim", REQUIRED), ("qk_rope_head_dim", REQUIRED),
    ("q_lora_rank", REQUIRED), ("o_groups", REQUIRED), ("o_lora_rank", REQUIRED),
    ("sliding_window", REQUIRED), ("compress_ratios", REQUIRED),
    ("kv_source_layer_ids", REQUIRED), ("index_source_layer_ids", REQUIRED),
    ("candidate_source_layer_id", None), ("candidate_topk_blocks", 0),
    ("candidate_block_size", 1), ("index_n_heads", REQUIRED), ("index_head_dim", REQUIRED),
    ("index_topk", REQUIRED), ("rope_theta", REQUIRED), ("compress_rope_theta", REQUIRED),
    ("rope_scaling", None), ("rms_norm_eps", 1e-20), ("n_routed_experts", REQUIRED),
    ("num_experts_per_tok", REQUIRED), ("n_shared_experts", 1),
    ("moe_intermediate_size", REQUIRED), ("scoring_func", "sqrtsoftplus"),
    ("norm_topk_prob", True), ("routed_scaling_factor", 1.0), ("gate_temp", 1.0),
    ("swiglu_limit", 0.0), ("hc_mult", REQUIRED), ("hc_sinkhorn_iters", REQUIRED),
    ("hc_eps", REQUIRED), ("engram_layer_ids", []), ("engram_num_embeddings", []),
    ("engram_max_ngram_size", 0), ("engram_n_heads", 0), ("engram_head_dim", 0),
    ("engram_vocab_size", 0), ("engram_compressed_vocab_size", 0),
    ("engram_pad_token_id", 2), ("num_nextn_predict_layers", 0),
]

QUANT_EXPECTED = {"quant_method": "fp8", "weight_block_size": [32, 32], "scale_fmt": "ue8m0",
                  "expert_dtype": "fp4"}


class Config:
    """The config keys under their HF names, plus derived per-layer roles (MODEL.md §0.1)."""

    def __init__(self, raw):
        if not isinstance(raw, dict):
            raise RefError("config.json is not a JSON object")
        text = raw.get("text_config", raw)
        if not isinstance(text, dict):
            raise RefError("config.json: text_config is not an object")
        for key, default in CONFIG_KEYS:
            if key in text:
                setattr(self, key, text[key])
            elif default is REQUIRED:
                raise RefError(f"config.json: missing key {key}")
            else:
                setattr(self, key, default)
        quant = raw.get("quantization_config", text.get("quantization_config"))
        if quant is not None:
            for key, want in QUANT_EXPECTED.items():
                if key in quant and quant[key] != want:
                    raise RefError(f"config.json: quantization_config.{key} = {quant[key]!r}, "
                                   f"only {want!r} is supported")
        self._derive()
        self._validate()

    def _derive(self):
        L = self.num_hidden_layers
        if not isinstance(self.compress_ratios, list) or len(self.compress_ratios) < L:
            raise RefError(f"config.json: compress_ratios needs at least {L} entries")
        self.ratios = [int(r) for r in self.compress_ratios[:L]]
        self.kv_sources = sorted(int(x) for x in self.kv_source_layer_ids)
        self.index_sources = sorted(int(x) for x in self.index_source_layer_ids)
        self.kv_source_of = {}
        self.index_source_of = {}
        for l in range(L):
            if self.ratios[l] == 0:
                continue
            kv = [s for s in self.kv_sources if s <= l]
            ix = [s for s in self.index_sources if s <= l]
            if not kv or not ix:
                raise RefError(f"config.json: layer {l} has ratio {self.ratios[l]} but no KV "
                               f"source or index source at or below it")
            self.kv_source_of[l], self.index_source_of[l] = kv[-1], ix[-1]
        self.mix_width = (2 + self.hc_mult) * self.hc_mult

    def _validate(self):
        D, hd, rd = self.hidden_size, self.head_dim, self.qk_rope_head_dim
        checks = [
            (D % 32 == 0, f"hidden_size {D} not a multiple of 32"),
            (self.q_lora_rank % 32 == 0, f"q_lora_rank {self.q_lora_rank} not a multiple of 32"),
            (hd % 32 == 0, f"head_dim {hd} not a multiple of 32"),
            (rd % 2 == 0 and 0 < rd <= hd, f"qk_rope_head_dim {rd} not even in (0, head_dim]"),
            (self.num_attention_heads % self.o_groups == 0,
             f"num_attention_heads {self.num_attention_heads} not divisible by o_groups "
             f"{self.o_groups}"),
            ((self.num_attention_heads // self.o_groups * hd) % 32 == 0,
             "heads per group x head_dim not a multiple of 32"),
            ((self.o_groups * self.o_lora_rank) % 32 == 0,
             "o_groups x o_lora_rank not a multiple of 32"),
            (self.moe_intermediate_size % 32 == 0, "moe_intermediate_size not a multiple of 32"),
            (self.index_head_dim % 32 == 0 and self.index_head_dim >= rd,
             f"index_head_dim {self.index_head_dim} not a multiple of 32 >= qk_rope_head_dim"),
            (self.scoring_func == "sqrtsoftplus",
             f"scoring_func {self.scoring_func!r}: only 'sqrtsoftplus' is in MODEL.md"),
            (self.sliding_window >= 1, f"sliding_window {self.sliding_window} < 1"),
        ]
        for l, r in enumerate(self.ratios):
            checks.append((r in (0, 1, 2), f"compress ratio {r} at layer {l}: MODEL.md defines "
                                           f"0, 1 and 2 only"))
        for l, kv in self.kv_source_of.items():
            checks.append((self.ratios[kv] == self.ratios[l] and all(
                self.ratios[i] == self.ratios[l] for i in range(kv, l + 1)),
                f"layer {l} and its KV source {kv} are not in one band of equal ratio"))
            checks.append((self.index_source_of[l] >= kv,
                           f"layer {l}: index source {self.index_source_of[l]} lies below its "
                           f"KV source {kv}"))
        for s in self.kv_sources + self.index_sources:
            checks.append((0 <= s < self.num_hidden_layers and self.ratios[s] > 0,
                           f"source layer {s} is not a layer with ratio > 0"))
        for s in self.index_sources:
            if s not in self.kv_sources:
                checks.append((self.candidate_source_layer_id == self.kv_source_of[s],
                               f"index source {s} re-indexes layer {self.kv_source_of[s]}'s keys "
                               f"but that layer is not the candidate source"))
        c = self.candidate_source_layer_id
        if c is not None:
            checks.append((c in self.kv_sources and c in self.index_sources,
                           f"candidate source {c} is not both a KV and an index source"))
            cb, ck = self.candidate_block_size, self.candidate_topk_blocks
            checks.append((cb >= 1 and ck >= 1 and (ck - 1) * cb + 1 >= self.index_topk,
                           f"candidate blocks {ck} x {cb} cannot always hold index_topk "
                           f"{self.index_topk} entries"))
        if self.engram_layer_ids:
            checks.append((self.engram_head_dim % 32 == 0,
                           f"engram_head_dim {self.engram_head_dim} not a multiple of 32"))
            checks.append((self.engram_max_ngram_size >= 2 and self.engram_n_heads >= 1 and
                           self.engram_compressed_vocab_size >= 1,
                           "engram_max_ngram_size, engram_n_heads or "
                           "engram_compressed_vocab_size out of range"))
        for ok, msg in checks:
            if not ok:
                raise RefError(f"config.json: {msg}")


# ---------------------------------------------------------------------------------------------
# Engram hashing (MODEL.md §2.9)
# ---------------------------------------------------------------------------------------------

def is_prime(n):
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    i = 3
    while i * i <= n:
        if n % i == 0:
            return False
        i += 2
    return True


def engram_primes(vocab_size, layer_ids, max_ngram, n_heads):
    """Per layer, per n-gram order 2..max_ngram, n_heads primes. For each order the search
    starts after vocab_size(order) - 1 and takes the next unused primes; the used set is shared
    across layers. vocab_size is one number for every order or a list, one per order."""
    orders = max_ngram - 1
    sizes = vocab_size if isinstance(vocab_size, list) else [vocab_size] * orders
    if len(sizes) != orders:
        raise RefError(f"engram_vocab_size has {len(sizes)} entries, expected {orders}")
    used = set()
    primes = {}
    for layer in layer_ids:
        per_order = []
        for n in range(orders):
            found = []
            cand = int(sizes[n]) - 1
            while len(found) < n_heads:
                cand += 1
                if cand not in used and is_prime(cand):
                    used.add(cand)
                    found.append(cand)
            per_order.append(found)
        primes[layer] = per_order
    return primes


def engram_multipliers(layer_id, compressed_vocab, max_ngram):
    """Odd int64 multipliers for lookback 0..max_ngram-1, from default_rng(10007 * layer_id)."""
    half_bound = max(1, ((2 ** 63 - 1) // compressed_vocab) // 2)
    rng = np.random.default_rng(10007 * layer_id)
    r = rng.integers(low=0, high=half_bound, size=(max_ngram,), dtype=np.int64)
    return [int(v) * 2 + 1 for v in r]


def load_token_map(model_dir, cfg, map_file=None):
    """(map [vocab] int64, compressed pad id). MODEL.md's order: the map built from
    tokenizer.json when the directory has one (not implemented here: such a directory needs
    map_file, e.g. the map the engine built, written as engram_token_map.json's format), else
    engram_token_map.json, else the identity map modulo engram_compressed_vocab_size."""
    cvs = cfg.engram_compressed_vocab_size
    pad = cfg.engram_pad_token_id
    path = map_file or os.path.join(model_dir, "engram_token_map.json")
    if map_file is None and os.path.exists(os.path.join(model_dir, "tokenizer.json")):
        raise RefError(f"{model_dir}: has tokenizer.json, from which MODEL.md builds the Engram "
                       f"token map; this reference does not build it: pass --token-map FILE")
    if map_file is not None or os.path.exists(path):
        try:
            with open(path) as f:
                doc = json.load(f)
            cmap = np.asarray(doc["map"], dtype=np.int64)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise RefError(f"{path}: unreadable ({e})") from None
        pad = int(doc.get("pad_token_id", pad))
        if doc.get("vocab_size", cfg.vocab_size) != cfg.vocab_size or \
                cmap.shape != (cfg.vocab_size,):
            raise RefError(f"{path}: map does not have vocab_size {cfg.vocab_size} entries")
        if doc.get("compressed_vocab_size", cvs) != cvs:
            raise RefError(f"{path}: compressed_vocab_size {doc.get('compressed_vocab_size')} "
                           f"!= config's {cvs}")
        if cmap.size and (cmap.min() < 0 or cmap.max() >= cvs):
            raise RefError(f"{path}: map entries outside [0, {cvs})")
    else:
        cmap = np.arange(cfg.vocab_size, dtype=np.int64) % cvs
    if not 0 <= pad < cfg.vocab_size:
        raise RefError(f"engram pad token id {pad} outside the vocabulary")
    return cmap, int(cmap[pad])


def engram_hash_ids(ids, cfg, cmap, cpad, primes):
    """Table rows [T, (max_ngram-1) * n_heads] per Engram layer, offsets included; column order
    (n-gram order, head)."""
    T = len(ids)
    N = cfg.engram_max_ngram_size
    cid = cmap[np.asarray(ids, dtype=np.int64)].astype(np.uint64)
    # tok[s][t] = cid(t - s), or the compressed pad once t - s < 0 (sticky: no image spans here)
    tok = []
    for s in range(N):
        shifted = np.full(T, cpad, dtype=np.uint64)
        if s < T:
            shifted[s:] = cid[: T - s]
        tok.append(shifted)
    out = {}
    for layer in cfg.engram_layer_ids:
        mult = [np.uint64(m) for m in engram_multipliers(layer, cfg.engram_compressed_vocab_size,
                                                         N)]
        flat = [p for order in primes[layer] for p in order]
        offsets = np.concatenate([[0], np.cumsum(flat)[:-1]]).astype(np.uint64)
        cols = []
        r = tok[0] * mult[0]
        for n in range(1, N):
            r = r ^ (tok[n] * mult[n])
            for k, p in enumerate(primes[layer][n - 1]):
                col = (n - 1) * cfg.engram_n_heads + k
                cols.append(r % np.uint64(p) + offsets[col])
        out[layer] = np.stack(cols, axis=1).astype(np.int64)
    return out


# ---------------------------------------------------------------------------------------------
# Arithmetic building blocks
# ---------------------------------------------------------------------------------------------

def mm(x, w):
    """x [.., K] times w [N, K]^T, computed exactly enough and rounded once to fp32."""
    return f32(np.matmul(np.asarray(x, dtype=F64), np.asarray(w, dtype=F64).T))


def linear_q(x, w):
    """Quantised Linear (FP8 or FP4 weight already dequantised): FP8 activation per 32 (A),
    fp32 accumulation, bf16 output (§2.2)."""
    return bf16(mm(quant_a(x), w))


def linear_bf16(x, w):
    """BF16 Linear: bf16 input and weight, fp32 accumulation, bf16 output."""
    return bf16(mm(x, w))


def rmsnorm(x, w, eps):
    """y = w * x / sqrt(mean(x^2) + eps) in fp32, result bf16 (§2.1)."""
    x = np.asarray(x, dtype=F64)
    ms = f32(np.mean(x * x, axis=-1, keepdims=True))
    r = f32(1.0 / np.sqrt(F64(f32(ms + F32(eps)))))
    return bf16(f32(f32(x * r) * w))


# Transcendental functions go through the C library (math.*) one element at a time: NumPy's
# vectorised float64 exp/sin/cos are not correctly rounded and differ between CPU code paths,
# which would make the reference's fp32 roundings depend on the machine.
_EXP = np.frompyfunc(lambda v: math.exp(v) if v < 709.0 else math.inf, 1, 1)
_LOG1P = np.frompyfunc(math.log1p, 1, 1)
_SIN = np.frompyfunc(math.sin, 1, 1)
_COS = np.frompyfunc(math.cos, 1, 1)


def _libm(fn, x):
    x = np.asarray(x, dtype=F64)
    return np.asarray(fn(x), dtype=F64).reshape(x.shape)


def exp(x):
    return _libm(_EXP, x)


def sigmoid(x):
    return 1.0 / (1.0 + exp(-np.asarray(x, dtype=F64)))


def softplus(x):
    """ln(1 + e^x) without overflow."""
    x = np.asarray(x, dtype=F64)
    return np.maximum(x, 0.0) + _libm(_LOG1P, exp(-np.abs(x)))


def rope_freqs(cfg, ratio):
    """The rd/2 fp32 frequencies of a layer (§2.4): theta 1e4 without YaRN for ratio 0,
    compress_rope_theta with YaRN otherwise. Also returns the YaRN bounds (lo, hi) or None."""
    d = cfg.qk_rope_head_dim
    base = cfg.rope_theta if ratio == 0 else cfg.compress_rope_theta
    i = np.arange(d // 2, dtype=F64)
    f = f32(base ** (-2.0 * i / d))
    ys = cfg.rope_scaling
    if ratio == 0 or not ys or ys.get("type", ys.get("rope_type")) != "yarn":
        return f, None
    lo, hi = yarn_bounds(d, base, ys["original_max_position_embeddings"], ys["beta_fast"],
                         ys["beta_slow"])
    ramp = np.clip((i - lo) / max(hi - lo, 0.001), 0.0, 1.0)
    fac = ys["factor"]
    f = f32(f * (1.0 - ramp) + f32(f / fac) * ramp)
    return f, (lo, hi)


def yarn_bounds(d, base, orig_len, beta_fast, beta_slow):
    def corr(r):
        return d * math.log(orig_len / (2 * math.pi * r)) / (2 * math.log(base))
    return max(math.floor(corr(beta_fast)), 0), min(math.ceil(corr(beta_slow)), d - 1)


def rope_table(pos, freqs):
    """cos and sin [T, rd/2] of the fp32 angles pos[t] * f_i, each rounded to fp32."""
    ang = f32(np.asarray(pos, dtype=F64)[:, None] * freqs[None, :])
    return f32(_libm(_COS, ang)), f32(_libm(_SIN, ang))


def rope(x, pos, freqs, inverse=False):
    """Rotates adjacent pairs of the LAST 2*len(freqs) numbers of x [T, ..., n] by pos[t] * f
    (fp32 angle), fp32 compute, bf16 write-back (§2.4)."""
    x = np.array(x, dtype=F32)
    rd = 2 * len(freqs)
    cos, sin = rope_table(pos, freqs)
    if inverse:
        sin = -sin
    shape = (x.shape[0],) + (1,) * (x.ndim - 2) + (rd // 2,)
    cos, sin = cos.reshape(shape).astype(F64), sin.reshape(shape).astype(F64)
    a = x[..., -rd::2].astype(F64)
    b = x[..., -rd + 1::2].astype(F64)
    x[..., -rd::2] = bf16(f32(f32(a * cos) - f32(b * sin)))
    x[..., -rd + 1::2] = bf16(f32(f32(a * sin) + f32(b * cos)))
    return x


def topk_ascending(scores, k):
    """The k best entries of a score row (ties to the lower index), re-sorted ascending; picks
    whose score is -inf become -1 (MODEL.md §2.7)."""
    order = np.argsort(-scores, kind="stable")[:k]
    picked = np.sort(order)
    return np.where(np.isneginf(scores[picked]), -1, picked)


ATTN_BLOCK = 64


def sparse_attn_row(q, keys, block, scale, sink):
    """One query row of the reference kernel's sparse attention (MODEL.md §2.5 (a)-(d)): keys
    [n, hd] in slot order, block[n] the 64-slot block of each key. Running fp32 max from -1e30,
    fp32 probabilities in the denominator, probabilities rounded to BF16 in the numerator,
    both rescaled by exp(m - m') per block; bf16 output [H, hd]."""
    H, hd = q.shape
    s = f32(f32(q.astype(F64) @ keys.T) * scale)                              # [H, n] fp32
    m = np.full(H, F32(-1e30), dtype=F32)
    den = np.zeros(H, dtype=F32)
    acc = np.zeros((H, hd), dtype=F32)
    for b in np.unique(block):
        sel = block == b
        mb = np.maximum(m, s[:, sel].max(axis=1))
        alpha = f32(exp(f32(m - mb)))
        p = f32(exp(f32(s[:, sel] - mb[:, None])))                             # [H, nb] fp32
        den = f32(f32(den * alpha) + f32(p.astype(F64).sum(axis=1)))
        pv = f32(bf16(p).astype(F64) @ keys[sel])
        acc = f32(f32(acc * alpha[:, None]) + pv)
        m = mb
    den = f32(den + f32(exp(f32(f32(sink) - m))))
    return bf16(acc / den[:, None])                                          # fp32 division


def n_visible(p, r):
    """Compressed entries visible to the token at position p: j < floor((p + 1) / r)."""
    return (p + 1) // r


def window_positions(p, W):
    """Window keys of the token at position p: max(0, p - W + 1) .. p."""
    return np.arange(max(0, p - W + 1), p + 1)


def candidate_mask(scores, n_vis, block, keep):
    """Layer-20-style candidate blocks for one query (§2.7): block score = max of its entries
    (invisible entries are -inf), the block holding the newest visible entry pinned to +inf, the
    top `keep` blocks kept (ties to the lower block), -inf picks dropped. Returns a bool mask over
    the entries."""
    n = len(scores)
    nb = -(-n // block)
    padded = np.full(nb * block, -np.inf)
    padded[:n] = scores
    bscore = padded.reshape(nb, block).max(axis=1)
    if n_vis > 0:
        bscore[(n_vis - 1) // block] = np.inf
    kept = np.argsort(-bscore, kind="stable")[:min(keep, nb)]
    kept = kept[~np.isneginf(bscore[kept])]
    mask = np.zeros(nb * block, dtype=bool)
    for b in kept:
        mask[b * block:(b + 1) * block] = True
    return mask[:n]


# ---------------------------------------------------------------------------------------------
# mHC (MODEL.md §2.3)
# ---------------------------------------------------------------------------------------------

def sinkhorn(Z, iters, eps):
    """Z [.., n, n] -> row softmax + eps, column step, then (iters - 1) x (row step, column
    step); ends on a column normalisation."""
    Z = np.asarray(Z, dtype=F64)
    S = exp(Z - Z.max(axis=-1, keepdims=True))
    S = S / S.sum(axis=-1, keepdims=True) + eps
    S = S / (S.sum(axis=-2, keepdims=True) + eps)
    for _ in range(iters - 1):
        S = S / (S.sum(axis=-1, keepdims=True) + eps)
        S = S / (S.sum(axis=-2, keepdims=True) + eps)
    return f32(S)


def hc_mixes(H, fn, base, scale, cfg):
    """H [T, hc, D] (bf16 values) -> pre [T, hc], post [T, hc], comb [T, hc, hc] (fp32)."""
    T, hc, D = H.shape
    v = H.reshape(T, hc * D).astype(F64)
    ms = f32(np.mean(v * v, axis=1, keepdims=True))
    r = f32(1.0 / np.sqrt(F64(f32(ms + F32(cfg.rms_norm_eps)))))
    m = f32(mm(v, fn) * r)                                              # [T, (2 + hc) hc]
    sc = f32(scale)

    def affine(part, k, b):           # fp32 product m * scale[k], then fp32 sum with the base
        return f32(f32(part * sc[k]).astype(F64) + b)
    pre = f32(f32(sigmoid(affine(m[:, :hc], 0, base[:hc]))) + F32(cfg.hc_eps))
    post = f32(2.0 * sigmoid(affine(m[:, hc:2 * hc], 1, base[hc:2 * hc])))
    Z = affine(m[:, 2 * hc:], 2, base[2 * hc:]).reshape(T, hc, hc)
    return pre, post, sinkhorn(Z, cfg.hc_sinkhorn_iters, cfg.hc_eps)


def hc_collapse(H, pre):
    """sum_c pre[c] * H[c], fp32 accumulation, bf16 result."""
    return bf16(f32(np.einsum("tc,tcd->td", pre.astype(F64), H.astype(F64))))


def hc_expand(H, y, post, comb):
    """H'[j] = post[j] * y + sum_i comb[i][j] * H[i] in fp32, stored bf16 (column j of comb)."""
    mix = np.einsum("tij,tid->tjd", comb.astype(F64), H.astype(F64))
    return bf16(f32(post.astype(F64)[:, :, None] * y.astype(F64)[:, None, :] + mix))


# ---------------------------------------------------------------------------------------------
# The model
# ---------------------------------------------------------------------------------------------

class Model:
    """Weights of the backbone (draft stages and vision are not read) and the prefill forward."""

    def __init__(self, model_dir, token_map=None):
        path = os.path.join(model_dir, "config.json")
        try:
            with open(path) as f:
                raw = json.load(f)
        except (OSError, ValueError) as e:
            raise RefError(f"{path}: unreadable ({e})") from None
        self.cfg = cfg = Config(raw)
        self.raw_text = raw.get("text_config", raw)
        self.ck = Checkpoint(model_dir)
        D, V = cfg.hidden_size, cfg.vocab_size
        self.embed = self.ck.plain("embed.weight", [V, D])
        self.head = self.ck.plain("head.weight", [V, D])
        self.norm = self.ck.plain("norm.weight", [D])
        self.freqs = {r: rope_freqs(cfg, r)[0] for r in set(cfg.ratios)}
        self.primes = {}
        if cfg.engram_layer_ids:
            self.cmap, self.cpad = load_token_map(model_dir, cfg, token_map)
            self.primes = engram_primes(cfg.engram_vocab_size, cfg.engram_layer_ids,
                                        cfg.engram_max_ngram_size, cfg.engram_n_heads)
        self.layers = [self._load_layer(l) for l in range(cfg.num_hidden_layers)]

    # --- loading -------------------------------------------------------------------------------

    def _load_layer(self, l):
        cfg, ck = self.cfg, self.ck
        D, H, hd = cfg.hidden_size, cfg.num_attention_heads, cfg.head_dim
        G, olr, qlr = cfg.o_groups, cfg.o_lora_rank, cfg.q_lora_rank
        hc, mw = cfg.hc_mult, cfg.mix_width
        p = f"layers.{l}."
        w = {
            "attn_norm": ck.plain(p + "attn_norm.weight", [D]),
            "ffn_norm": ck.plain(p + "ffn_norm.weight", [D]),
            "wq_a": ck.fp8(p + "attn.wq_a.weight", [qlr, D]),
            "q_norm": ck.plain(p + "attn.q_norm.weight", [qlr]),
            "wq_b": ck.fp8(p + "attn.wq_b.weight", [H * hd, qlr]),
            "wkv": ck.fp8(p + "attn.wkv.weight", [hd, D]),
            "kv_norm": ck.plain(p + "attn.kv_norm.weight", [hd]),
            # wo_a is FP8 on disk and computed as a bf16 einsum: FP8 x scale is exact in bf16
            "wo_a": bf16(ck.fp8(p + "attn.wo_a.weight", [G * olr, H * hd // G])),
            "wo_b": ck.fp8(p + "attn.wo_b.weight", [D, G * olr]),
            "sink": ck.plain(p + "attn.attn_sink", [H]),
        }
        for site in ("attn", "ffn"):
            w[f"hc_{site}_fn"] = ck.plain(p + f"hc_{site}_fn", [mw, hc * D])
            w[f"hc_{site}_base"] = ck.plain(p + f"hc_{site}_base", [mw])
            w[f"hc_{site}_scale"] = ck.plain(p + f"hc_{site}_scale", [3])
        r = cfg.ratios[l]
        if l in cfg.kv_sources:
            c = p + "attn.compressor."
            w["c_wkv"] = ck.plain(c + "wkv.weight", [hd, D])
            if r == 1:
                w["c_wkv"] = bf16(w["c_wkv"])
            else:
                w["c_wgate"] = ck.plain(c + "wgate.weight", [hd, D])
            w["c_norm"] = ck.plain(c + "norm.weight", [hd])
        if l in cfg.index_sources:
            ih, idim = cfg.index_n_heads, cfg.index_head_dim
            i = p + "attn.indexer."
            w["i_wq_b"] = ck.fp8(i + "wq_b.weight", [ih * idim, qlr])
            w["i_wproj"] = bf16(ck.plain(i + "weights_proj.weight", [ih, D]))
            if l in cfg.kv_sources:
                w["i_wk"] = bf16(ck.plain(i + "wk.weight", [idim, hd]))
                w["i_knorm"] = ck.plain(i + "k_norm.weight", [idim])
        w.update(self._load_moe(p))
        if l in cfg.engram_layer_ids:
            w.update(self._load_engram(l, p))
        return w

    def _load_moe(self, p):
        cfg, ck = self.cfg, self.ck
        D, E, I = cfg.hidden_size, cfg.n_routed_experts, cfg.moe_intermediate_size
        Is = cfg.n_shared_experts * I
        f = p + "ffn."
        w = {"gate": ck.plain(f + "gate.weight", [E, D]),
             "gate_bias": ck.plain(f + "gate.bias", [E]) if ck.has(f + "gate.bias")
             else np.zeros(E),
             "experts": [(ck.fp4(f"{f}experts.{e}.w1.weight", [I, D]),
                          ck.fp4(f"{f}experts.{e}.w3.weight", [I, D]),
                          ck.fp4(f"{f}experts.{e}.w2.weight", [D, I])) for e in range(E)]}
        if cfg.n_shared_experts:
            s = f + "shared_experts."
            w["shared"] = (ck.fp8(s + "w1.weight", [Is, D]), ck.fp8(s + "w3.weight", [Is, D]),
                           ck.fp8(s + "w2.weight", [D, Is]))
        return w

    def _load_engram(self, l, p):
        cfg, ck = self.cfg, self.ck
        D, hc = cfg.hidden_size, cfg.hc_mult
        rows = sum(sum(order) for order in self.primes[l])
        idx = cfg.engram_layer_ids.index(l)
        if idx < len(cfg.engram_num_embeddings) and cfg.engram_num_embeddings[idx] != rows:
            raise RefError(f"config.json: engram_num_embeddings[{idx}] = "
                           f"{cfg.engram_num_embeddings[idx]}, but the primes of layer {l} sum "
                           f"to {rows}")
        lookups = (cfg.engram_max_ngram_size - 1) * cfg.engram_n_heads
        e = p + "engram."
        if not ck.has(e + "embed.weight") and "engram_table_seed" in self.raw_text:
            raise RefError(f"checkpoint has no {e}embed.weight (config.json asks for seeded "
                           f"Engram tables, engram_table_seed); write the table tensors")
        return {
            "e_table": bf16(ck.fp8_rows(e + "embed.weight", [rows, cfg.engram_head_dim])),
            "e_wkv": ck.fp8(e + "wkv.weight", [(hc + 1) * D, lookups * cfg.engram_head_dim]),
            "e_q": ck.plain(e + "q_weight", [hc, D]),
            "e_k": ck.plain(e + "k_weight", [hc, D]),
        }

    # --- forward -------------------------------------------------------------------------------

    def forward(self, ids, trace=None):
        """Prefill over ids from position 0: fp32 logits [T, vocab]. trace (a dict or None)
        collects named intermediates."""
        cfg = self.cfg
        ids = np.asarray(ids, dtype=np.int64)
        if ids.ndim != 1 or ids.size == 0:
            raise RefError("need at least one token id")
        if ids.min() < 0 or ids.max() >= cfg.vocab_size:
            raise RefError(f"token id outside [0, {cfg.vocab_size})")
        T, hc = len(ids), cfg.hc_mult
        tr = trace if trace is not None else {}
        hashes = (engram_hash_ids(ids, cfg, self.cmap, self.cpad, self.primes)
                  if cfg.engram_layer_ids else {})
        e = bf16(self.embed[ids])                                         # [T, D]
        H = np.repeat(e[:, None, :], hc, axis=1)                          # [T, hc, D] bf16
        pre = np.zeros((T, hc), dtype=F32)
        pre[:, 0] = 1.0
        shared = {}   # per-layer products read by later layers: compressed KV, keys, top-k, masks
        for l, w in enumerate(self.layers):
            if l in hashes:
                H = self.engram(H, hashes[l], w)
                tr[f"L{l}.engram_H"] = H
            a_pre, a_post, a_comb = hc_mixes(H, w["hc_attn_fn"], w["hc_attn_base"],
                                             w["hc_attn_scale"], cfg)
            x = rmsnorm(hc_collapse(H, pre), w["attn_norm"], cfg.rms_norm_eps)
            y = self.attention(l, x, w, shared, tr)
            H = hc_expand(H, y, a_post, a_comb)
            f_pre, f_post, f_comb = hc_mixes(H, w["hc_ffn_fn"], w["hc_ffn_base"],
                                              w["hc_ffn_scale"], cfg)
            x2 = rmsnorm(hc_collapse(H, a_pre), w["ffn_norm"], cfg.rms_norm_eps)
            y2 = self.moe(x2, w)
            H = hc_expand(H, y2, f_post, f_comb)
            pre = f_pre
            tr.update({f"L{l}.attn_in": x, f"L{l}.attn_out": y, f"L{l}.ffn_in": x2,
                       f"L{l}.ffn_out": y2, f"L{l}.H": H})
        h = rmsnorm(hc_collapse(H, pre), self.norm, cfg.rms_norm_eps)
        tr["final_h"] = h
        return mm(h, self.head)                                           # [T, V] fp32

    def engram(self, H, rows_idx, w):
        """MODEL.md §2.9 module: H [T, hc, D] -> H + gate * value per copy."""
        cfg = self.cfg
        T, hc, D = H.shape
        rows = w["e_table"][rows_idx].reshape(T, -1)                     # [T, 24 * 256] bf16
        kv = linear_q(rows, w["e_wkv"]).astype(F64)                       # [T, (hc + 1) D]
        key, value = kv[:, :hc * D].reshape(T, hc, D), kv[:, hc * D:]
        Hd = H.astype(F64)
        wc = f32(w["e_q"] * w["e_k"]).astype(F64)                         # [hc, D]
        eps = cfg.rms_norm_eps
        r_h = 1.0 / np.sqrt(F64(f32(np.mean(Hd * Hd, axis=2))) + eps)
        r_k = 1.0 / np.sqrt(F64(f32(np.mean(key * key, axis=2))) + eps)
        dot = f32(f32(np.sum(Hd * wc[None] * key, axis=2)) * f32(r_h * r_k) / math.sqrt(D))
        dot = dot.astype(F64)
        gate = f32(sigmoid(np.sign(dot) * np.sqrt(np.maximum(np.abs(dot), 1e-6))))
        return bf16(f32(Hd + gate.astype(F64)[:, :, None] * value[:, None, :]))

    def attention(self, l, x, w, shared, tr):
        """MODEL.md §2.5: x [T, D] (normed, bf16) -> [T, D] bf16."""
        cfg = self.cfg
        T = x.shape[0]
        Hn, hd, G = cfg.num_attention_heads, cfg.head_dim, cfg.o_groups
        r = cfg.ratios[l]
        freqs = self.freqs[r]
        pos = np.arange(T)
        qr = rmsnorm(linear_q(x, w["wq_a"]), w["q_norm"], cfg.rms_norm_eps)      # [T, qlr]
        q = rope(linear_q(qr, w["wq_b"]).reshape(T, Hn, hd), pos, freqs)          # [T, H, hd]
        kv = rmsnorm(linear_q(x, w["wkv"]), w["kv_norm"], cfg.rms_norm_eps)      # [T, hd]
        kv = quant_a(rope(kv[:, None, :], pos, freqs)[:, 0])                       # FP8 window
        comp, topk = None, None
        if r > 0:
            if l in cfg.kv_sources:
                self.compress(l, x, w, shared)
            if l in cfg.index_sources:
                self.index(l, x, qr, w, shared)
            comp = shared[("kv", cfg.kv_source_of[l])]
            topk = shared[("topk", cfg.index_source_of[l])]
            tr[f"L{l}.topk"] = topk
        scale = F32(1.0 / math.sqrt(hd))
        o = np.zeros((T, Hn, hd), dtype=F32)
        for t in range(T):
            wpos = window_positions(t, cfg.sliding_window)
            keys = kv[wpos]
            # key slots: the window padded to sliding_window slots, then every top-k slot
            slot = np.arange(len(wpos))
            if topk is not None:
                valid = topk[t] >= 0
                keys = np.concatenate([keys, comp[topk[t][valid]]], axis=0)
                slot = np.concatenate([slot, cfg.sliding_window + np.nonzero(valid)[0]])
            o[t] = sparse_attn_row(q[t], keys.astype(F64), slot // ATTN_BLOCK, scale, w["sink"])
        o = rope(o, pos, freqs, inverse=True)
        u = o.reshape(T, G, Hn // G * hd).astype(F64)
        wo_a = w["wo_a"].reshape(G, cfg.o_lora_rank, Hn // G * hd)
        z = bf16(f32(np.einsum("tgk,gnk->tgn", u, wo_a))).reshape(T, -1)  # [T, G * olr]
        return linear_q(z, w["wo_b"])

    def compress(self, l, x, w, shared):
        """MODEL.md §2.6 for a KV source: compressed entries (FP4, procedure C) and, for index
        owners, index keys (FP4, procedure B), one per complete group of r tokens."""
        cfg = self.cfg
        r, hd = cfg.ratios[l], cfg.head_dim
        n = x.shape[0] // r
        if r == 1:
            lat = linear_bf16(x, w["c_wkv"])                                 # [n, hd]
        else:
            a = mm(x, w["c_wkv"])[:n * r].reshape(n, r, hd).astype(F64)       # fp32
            g = mm(x, w["c_wgate"])[:n * r].reshape(n, r, hd).astype(F64)
            g = exp(g - g.max(axis=1, keepdims=True))
            wt = f32(g / g.sum(axis=1, keepdims=True)).astype(F64)
            lat = bf16(f32(np.sum(wt * a, axis=1)))
        lat = rmsnorm(lat, w["c_norm"], cfg.rms_norm_eps)
        epos = np.arange(n) * r                                                 # j * r
        freqs = self.freqs[r]
        if l in cfg.index_sources:
            k = rmsnorm(linear_bf16(lat, w["i_wk"]), w["i_knorm"], cfg.rms_norm_eps)
            shared[("keys", l)] = quant_b(rope(k[:, None, :], epos, freqs)[:, 0])
        shared[("kv", l)] = quant_c(rope(lat[:, None, :], epos, freqs)[:, 0])

    def index(self, l, x, qr, w, shared):
        """MODEL.md §2.7 for an index source: per-query top-k lists [T, index_topk] (-1 padded),
        and candidate-block masks when l is the candidate source."""
        cfg = self.cfg
        T = x.shape[0]
        ih, idim = cfg.index_n_heads, cfg.index_head_dim
        r = cfg.ratios[l]
        kvsrc = cfg.kv_source_of[l]
        keys = shared[("keys", kvsrc)].astype(F64)                               # [n, idim]
        q = rope(linear_q(qr, w["i_wq_b"]).reshape(T, ih, idim), np.arange(T), self.freqs[r])
        q = quant_b(q).astype(F64)                                               # [T, ih, idim]
        # the reference computes on BF16 tensors: each head's dot, the head weight and each
        # weighted product are rounded to BF16; the head sum runs in fp32 (head order)
        hw = bf16(linear_bf16(x, w["i_wproj"]) * F32(F64(idim) ** -0.5 * F64(ih) ** -0.5))
        dots = bf16(np.einsum("thd,nd->thn", q, keys))                            # [T, ih, n]
        prod = bf16(hw[:, :, None] * np.maximum(dots, F32(0.0)))                  # fp32 product
        acc = np.zeros((T, keys.shape[0]), dtype=F32)
        for h in range(ih):
            acc = acc + prod[:, h]                                                # fp32 adds
        score = bf16(acc).astype(F64)                                             # [T, n]
        topk = np.full((T, cfg.index_topk), -1, dtype=np.int64)
        masks = shared.get(("cand", kvsrc)) if l not in cfg.kv_sources else None
        cand = []
        for t in range(T):
            nv = n_visible(t, r)
            row = score[t].copy()
            row[nv:] = -np.inf
            if l == cfg.candidate_source_layer_id:
                cand.append(candidate_mask(row, nv, cfg.candidate_block_size,
                                           cfg.candidate_topk_blocks))
            if masks is not None:
                row[~masks[t]] = -np.inf
            k = min(cfg.index_topk, nv)
            topk[t, :k] = topk_ascending(row, k)
        if l == cfg.candidate_source_layer_id:
            shared[("cand", l)] = cand
        shared[("topk", l)] = topk

    def moe(self, x, w):
        """MODEL.md §2.8: x [T, D] bf16 -> [T, D] bf16."""
        cfg = self.cfg
        T = x.shape[0]
        z = f32(mm(x, w["gate"]) / cfg.gate_temp).astype(F64)
        s = f32(np.sqrt(F64(f32(softplus(z))))).astype(F64)                     # sqrt(softplus)
        ranked = f32(s + w["gate_bias"]).astype(F64)
        k = cfg.num_experts_per_tok
        sel = np.argsort(-ranked, axis=1, kind="stable")[:, :k]                  # [T, k]
        ws = np.take_along_axis(s, sel, axis=1)
        if cfg.norm_topk_prob:
            ws = f32(ws / F64(f32(ws.sum(axis=1, keepdims=True) + 1e-20))).astype(F64)
        ws = f32(ws * cfg.routed_scaling_factor)
        acc = np.zeros((T, cfg.hidden_size), dtype=F64)
        for e, (w1, w3, w2) in enumerate(w["experts"]):
            rows, slot = np.nonzero(sel == e)
            if rows.size:
                acc[rows] += self.expert(x[rows], w1, w3, w2, ws[rows, slot])
        if "shared" in w:
            acc += self.expert(x, *w["shared"], np.ones(T, dtype=F32))
        return bf16(f32(acc))

    def expert(self, x, w1, w3, w2, weight):
        """SwiGLU with the asymmetric clamp; the routing weight is applied before W2."""
        lim = self.cfg.swiglu_limit
        g = linear_q(x, w1).astype(F64)
        u = linear_q(x, w3).astype(F64)
        if lim > 0:
            u = np.clip(u, -lim, lim)
            g = np.minimum(g, lim)
        silu = f32(g * sigmoid(g)).astype(F64)
        h = bf16(f32(f32(silu * u).astype(F64) * weight.astype(F64)[:, None]))
        return linear_q(h, w2).astype(F64)


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

def parse_ids(text):
    try:
        ids = [int(v) for v in text.split(",") if v.strip() != ""]
    except ValueError:
        raise RefError(f"--ids {text!r}: expected comma-separated integers") from None
    if not ids:
        raise RefError("--ids is empty")
    return ids


def main(argv=None):
    ap = argparse.ArgumentParser(
        prog="v41_ref.py",
        description="Independent NumPy reference of the V4.1 forward pass (MODEL.md). Prefills "
                    "the ids from position 0 and writes the fp32 logits of every position.")
    ap.add_argument("--model", required=True, help="checkpoint directory (config.json, "
                    "model.safetensors.index.json, shards)")
    ap.add_argument("--ids", required=True, help="token ids, comma-separated (e.g. 1,2,3)")
    out = ap.add_mutually_exclusive_group()
    out.add_argument("--out", help="write logits [T, vocab] float32 to this .npy file")
    out.add_argument("--json", action="store_true",
                     help="print {\"ids\": [...], \"logits\": [[...], ...]} on stdout")
    ap.add_argument("--trace", help="also save named intermediates to this .npz file")
    ap.add_argument("--token-map", help="Engram token map to use (engram_token_map.json "
                    "format) instead of the directory's; needed when it has tokenizer.json")
    args = ap.parse_args(argv)
    try:
        ids = parse_ids(args.ids)
        if not os.path.isdir(args.model):
            raise RefError(f"--model {args.model}: not a directory")
        model = Model(args.model, args.token_map)
        trace = {} if args.trace else None
        logits = model.forward(ids, trace)
    except RefError as e:
        print(f"v41_ref.py: error: {e}", file=sys.stderr)
        return 1
    if args.trace:
        np.savez(args.trace, **{k: np.asarray(v) for k, v in trace.items()})
    if args.out:
        np.save(args.out, logits)
    elif args.json:
        json.dump({"ids": ids, "logits": logits.tolist()}, sys.stdout)
        sys.stdout.write("\n")
    else:
        for t, row in enumerate(logits):
            print(f"pos {t} id {ids[t]} argmax {int(np.argmax(row))} max {float(row.max()):.6g}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
