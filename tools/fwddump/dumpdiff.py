#!/usr/bin/python3
"""dumpdiff.py: where does the engine's forward part from a reference dump?

    dumpdiff.py --model DIR --dump FILE.npz [--ids 3,17,42] [--fwddump PATH] [--tol 0.0156]
                [--all] [--keep DIR]

Runs di-fwddump (the engine's prefill on the CPU backend, every fwd_dump intermediate) on the
prompt of the dump and compares each tensor the two share, in the order the engine computes
them: float tensors by max|engine - ref| / max|ref| (a tensor parts when this exceeds --tol,
default 2^-6, i.e. a few BF16 steps of its largest element), index lists (L{l}.topk,
L{l}.ffn.ids) as sets per row (-1 = empty). Prints the first tensor that parts (layer, name, the
worst row and element) and exits 1; exits 0 when every shared tensor agrees; 2 on bad input.
The prompt comes from --ids, else from the dump's `ids` array, else from expected.json next to
the dump (the prompt whose dump_file names it). Dump names follow fwd_dump: L{l}.attn_in,
L{l}.attn.q, L{l}.compress.latent, L{l}.topk, L{l}.attn.o, L{l}.attn_out, L{l}.ffn_in,
L{l}.ffn.ids, L{l}.ffn_out, L{l}.H, L{l}.engram_H, final_h, logits.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

import numpy as np

INDEX_LISTS = ("topk", "ffn.ids")


def fail(msg):
    print(f"dumpdiff: {msg}", file=sys.stderr)
    sys.exit(2)


def prompt_ids(args, ref):
    if args.ids:
        try:
            return [int(v) for v in args.ids.split(",")]
        except ValueError:
            fail(f"--ids '{args.ids}' is not a list of token ids")
    if "ids" in ref:
        return [int(v) for v in ref["ids"]]
    exp = os.path.join(os.path.dirname(os.path.abspath(args.dump)), "expected.json")
    if os.path.exists(exp):
        with open(exp) as f:
            for p in json.load(f).get("prompts", []):
                if p.get("dump_file") == os.path.basename(args.dump):
                    return p["ids"]
    fail("no prompt: give --ids (the dump has no 'ids' and no expected.json names it)")


def as_sets(a):
    return [frozenset(int(v) for v in row if v >= 0) for row in a.reshape(a.shape[0], -1)]


def compare(name, eng, ref, tol):
    """(parts, summary) for one shared tensor."""
    if name.rsplit(".", 1)[-1] in INDEX_LISTS or name.endswith(".topk") or \
            name.endswith(".ffn.ids"):
        e, r = as_sets(eng), as_sets(ref)
        if len(e) != len(r):
            return True, f"rows {len(e)} vs {len(r)}"
        bad = [t for t in range(len(e)) if e[t] != r[t]]
        if not bad:
            return False, f"{len(e)} rows, same sets"
        t = bad[0]
        return True, (f"{len(bad)} of {len(e)} rows differ; first row {t}: engine "
                      f"{sorted(e[t])} vs reference {sorted(r[t])}")
    if eng.shape != ref.shape:
        return True, f"shape {eng.shape} vs {ref.shape}"
    d = np.abs(eng.astype(np.float64) - ref.astype(np.float64))
    scale = float(np.abs(ref).max()) or 1.0
    worst = np.unravel_index(int(np.argmax(d)), d.shape)
    rel = float(d.max()) / scale
    msg = (f"max-abs {d.max():.6g} (rel {rel:.3g} of max {scale:.4g}) at {tuple(int(i) for i in worst)}: "
           f"engine {eng[worst]:.6g} vs reference {ref[worst]:.6g}")
    return rel > tol, msg


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", required=True, help="checkpoint directory")
    ap.add_argument("--dump", required=True, help="reference dump (.npz)")
    ap.add_argument("--ids", help="prompt token ids (default: from the dump or expected.json)")
    ap.add_argument("--fwddump", help="di-fwddump executable (default: next to this script in "
                    "the build, or on PATH)")
    ap.add_argument("--tol", type=float, default=2.0 ** -6, help="relative tolerance")
    ap.add_argument("--all", action="store_true", help="print every shared tensor")
    ap.add_argument("--keep", help="write the engine's dump here and keep it")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    if not (args.tol > 0):
        fail("--tol must be positive")
    try:
        ref = np.load(args.dump)
    except (OSError, ValueError) as e:
        fail(f"{args.dump}: {e}")
    exe = args.fwddump or shutil.which("di-fwddump")
    if not exe:
        root = os.environ.get("DI_BUILD_ROOT", "build")
        exe = os.path.join(root, "tools", "fwddump", "di-fwddump")
    if not os.path.exists(exe):
        fail(f"di-fwddump not found ({exe}); give --fwddump")
    ids = prompt_ids(args, ref)
    out = args.keep or tempfile.mkdtemp(prefix="dumpdiff.")
    try:
        r = subprocess.run([exe, "--model", args.model, "--ids", ",".join(map(str, ids)),
                            "--out", out, "--threads", str(args.threads)],
                           capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            fail(f"di-fwddump failed: {r.stderr.strip()}")
        with open(os.path.join(out, "order.txt")) as f:
            order = [line.strip() for line in f if line.strip()]
        shared = [n for n in order if n in ref.files]
        if not shared:
            fail("the dump shares no tensor name with the engine's fwd_dump")
        print(f"{len(ids)} tokens; {len(shared)} shared tensors "
              f"(reference only: {len(set(ref.files) - set(order))}, engine only: "
              f"{len(set(order) - set(ref.files))})")
        first = None
        for name in shared:
            eng = np.load(os.path.join(out, name + ".npy"))
            parts, msg = compare(name, eng, ref[name], args.tol)
            if args.all or (parts and first is None):
                print(f"{'PARTS' if parts else 'same '} {name:24s} {msg}")
            if parts and first is None:
                first = name
                if not args.all:
                    break
        if first is None:
            print("every shared tensor agrees")
            return 0
        layer = first.split(".")[0]
        print(f"first difference: {first} ({'layer ' + layer[1:] if layer[0] == 'L' and layer[1:].isdigit() else 'after the layers'})")
        return 1
    finally:
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
