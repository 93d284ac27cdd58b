#!/usr/bin/python3
"""dumpdiff.py against the oracle's prompt-0 dump: the engine agrees everywhere; a dump with
one tensor changed is reported at exactly that layer and tensor; bad input exits 2.

    test_dumpdiff.py DUMPDIFF_PY DI_FWDDUMP
"""
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.environ.get("DI_SOURCE_ROOT", os.path.join(os.path.dirname(__file__), "..", ".."))
MODEL = os.path.join(ROOT, "tests", "data", "oracle", "v41-tiny-b")
failures = 0


def check(cond, what):
    global failures
    print(("ok   " if cond else "FAIL ") + what)
    failures += not cond


def run(tool, exe, dump, *extra):
    r = subprocess.run([sys.executable, tool, "--model", MODEL, "--dump", dump,
                        "--fwddump", exe, *extra], capture_output=True, text=True, timeout=240)
    return r.returncode, r.stdout + r.stderr


def main():
    tool, exe = sys.argv[1], sys.argv[2]
    import json
    with open(os.path.join(MODEL, "expected.json")) as f:
        ids = ",".join(map(str, json.load(f)["prompts"][0]["ids"]))
    dump = os.path.join(MODEL, "dump_p0.npz")

    rc, out = run(tool, exe, dump)
    check(rc == 0 and "every shared tensor agrees" in out, f"prompt 0 agrees (rc {rc}): {out!r}")

    ref = dict(np.load(dump))
    with tempfile.TemporaryDirectory() as tmp:
        bad = dict(ref)
        bad["L3.attn_out"] = ref["L3.attn_out"].copy()
        bad["L3.attn_out"][4, 17] += 0.5
        path = os.path.join(tmp, "changed_attn_out.npz")
        np.savez(path, **bad)
        rc, out = run(tool, exe, path, "--ids", ids)
        check(rc == 1 and "first difference: L3.attn_out (layer 3)" in out and "(4, 17)" in out,
              f"a changed L3.attn_out is named with its element (rc {rc}): {out!r}")

        bad = dict(ref)
        topk = ref["L5.topk"].copy()
        row = topk[6]
        row[row == row.max()] = -1                    # drop the newest pick of the last row
        bad["L5.topk"] = topk
        path = os.path.join(tmp, "changed_topk.npz")
        np.savez(path, **bad)
        rc, out = run(tool, exe, path, "--ids", ids)
        check(rc == 1 and "first difference: L5.topk (layer 5)" in out and "row 6" in out,
              f"a changed top-k list is named with its row (rc {rc}): {out!r}")

        rc, out = run(tool, exe, os.path.join(tmp, "missing.npz"), "--ids", ids)
        check(rc == 2 and out.startswith("dumpdiff: ") and out.count("\n") == 1,
              f"a missing dump is one line, exit 2 (rc {rc}): {out!r}")
        rc, out = run(tool, exe, dump, "--ids", "3,x")
        check(rc == 2 and "--ids" in out, f"bad --ids, exit 2 (rc {rc}): {out!r}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
