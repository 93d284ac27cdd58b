#!/usr/bin/env python3
"""What YOCO compact costs against the reference, on the oracle checkpoint.

Runs di-generate --teacher-force on every prompt of the oracle's expected.json with --yoco off
and with --yoco compact (optionally other --keep-tokens), and prints the largest absolute logit
difference of each against the reference (prefill row and the teacher-forced decode rows) and
of compact against off (engine against engine).

    tools/measure/yoco_fidelity.py --oracle DIR [--build build] [--keep 140,16]
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile


def run(build, oracle, prompt, yoco, keep, threads):
    with tempfile.NamedTemporaryFile(suffix=".jsonl", delete=False) as f:
        path = f.name
    ids = ",".join(str(t) for t in prompt["ids"])
    forced = ",".join(str(t) for t in prompt["greedy_tokens"])
    cmd = [os.path.join(build, "tools/generate/di-generate"), "--model", oracle, "--quiet",
           "--ids", ids, "--teacher-force", forced, "--dump-logits", path, "--yoco", yoco,
           "--threads", str(threads)]
    if yoco != "off":
        cmd += ["--keep-tokens", str(keep)]
    r = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if r.returncode != 0:
        sys.exit("di-generate failed: %s" % r.stderr.strip())
    rows = {}
    with open(path) as f:
        for line in f:
            d = json.loads(line)
            rows[d["position"]] = d["logits"]
    os.unlink(path)
    return rows


def maxabs(a, b):
    return max(abs(x - y) for x, y in zip(a, b))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--oracle", required=True, help="oracle checkpoint with expected.json")
    ap.add_argument("--build", default="build")
    ap.add_argument("--keep", default="140", help="--keep-tokens values for compact")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    exp = json.load(open(os.path.join(a.oracle, "expected.json")))
    keeps = [int(k) for k in a.keep.split(",")]
    print("%-7s %-14s %12s %12s %14s" % ("prompt", "mode", "prefill-ref", "decode-ref",
                                         "vs off (all)"))
    for i, p in enumerate(exp["prompts"]):
        L = p["length"]
        ref = {L - 1: p["prefill_logits"]}
        for s in p["decode_steps"]:
            ref[s["position"]] = s["logits"]
        off = run(a.build, a.oracle, p, "off", 0, a.threads)
        modes = [("off", off)] + [("compact/%d" % k, run(a.build, a.oracle, p, "compact", k,
                                                           a.threads)) for k in keeps]
        for name, rows in modes:
            pre = maxabs(rows[L - 1], ref[L - 1])
            dec = max(maxabs(rows[q], ref[q]) for q in ref if q != L - 1)
            eng = max(maxabs(rows[q], off[q]) for q in ref)
            print("%-7s %-14s %12.6f %12.6f %14.6f" % ("%d (%d)" % (i, L), name, pre, dec, eng))


if __name__ == "__main__":
    main()
