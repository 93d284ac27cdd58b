#!/usr/bin/python3
"""compare.py: the C engine's logits against the independent reference (v41_ref.py).

For each case it writes a checkpoint, runs
    di-generate --model DIR --ids PROMPT --teacher-force IDS --dump-logits FILE
(prefill logits of the prompt's last position, then the decode logits of every teacher-forced
position) and the reference's prefill over PROMPT + IDS, and compares each dumped row with the
reference row of the same position: rel = max|c - r| / max|r|. A case passes when every row is
within --tol (default 1e-4).

Cases:
  mk:NAME       checkpoint written by `di-mkmodel` for the shipped config NAME (tiny, small)
  ref:RECIPE    checkpoint written by make_ref_model.py (built-in tiny config; plain or
                perturbed recipe, random Engram token map for perturbed)

The binaries come from --mkmodel / --generate, else from $DI_BUILD_ROOT (built there with ninja
when missing). Exit status: 0 all cases pass, 1 a case disagrees, 2 a tool failed or is missing.

Usage: compare.py [--cases mk:tiny,ref:plain,...] [--prompt-len N] [--decode-len M]
                  [--seed S] [--tol T] [--keep DIR] [--mkmodel BIN] [--generate BIN]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import make_ref_model  # noqa: E402
import v41_ref as ref  # noqa: E402

# The tools' command lines, one row per use (edit here if a flag changes).
MKMODEL_CMD = ["{mkmodel}", "--quiet", "--seed", "{seed}", "{config}", "{out}"]
GENERATE_CMD = ["{generate}", "--model", "{model}", "--ids", "{ids}", "--teacher-force",
                "{teacher}", "--dump-logits", "{dump}"]
# binary name -> (path under the build root, ninja target)
TOOLS = {"mkmodel": ("tools/mkmodel/di-mkmodel", "tools/mkmodel/di-mkmodel"),
         "generate": ("tools/generate/di-generate", "tools/generate/di-generate")}

DEFAULT_CASES = "mk:tiny,mk:small,ref:plain,ref:perturbed"


class ToolError(Exception):
    """A tool is missing or failed: the comparison could not run."""


def locate(tool, given):
    if given:
        if not os.access(given, os.X_OK):
            raise ToolError(f"{given}: not an executable")
        return given
    root = os.environ.get("DI_BUILD_ROOT")
    if not root:
        raise ToolError(f"no --{tool} and DI_BUILD_ROOT is not set")
    rel, target = TOOLS[tool]
    path = os.path.join(root, rel)
    if not os.access(path, os.X_OK):
        p = subprocess.run(["ninja", "-C", root, "-j2", target], capture_output=True, text=True)
        if p.returncode != 0 or not os.access(path, os.X_OK):
            raise ToolError(f"cannot build {target} in {root}: "
                            f"{(p.stdout + p.stderr).strip().splitlines()[-1:]}")
    return path


def run(cmd, what, timeout=600):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if p.returncode != 0:
        tail = (p.stderr.strip() or p.stdout.strip()).splitlines()[-3:]
        raise ToolError(f"{what} failed (exit {p.returncode}): {' | '.join(tail)}")
    return p


def fill(template, **kw):
    return [part.format(**kw) for part in template]


def read_dump(path, vocab):
    """Rows of logits from a dump: .npy, JSON ({"logits": [[...]]} or [[...]]) or raw
    little-endian float32 [rows, vocab]."""
    with open(path, "rb") as f:
        head = f.read(6)
    if head == b"\x93NUMPY":
        arr = np.load(path)
    elif head[:1] in (b"{", b"["):
        with open(path) as f:
            doc = json.load(f)
        arr = np.asarray(doc["logits"] if isinstance(doc, dict) else doc, dtype=np.float32)
    else:
        raw = np.fromfile(path, dtype="<f4")
        if raw.size % vocab:
            raise ToolError(f"{path}: {raw.size} floats is not a whole number of {vocab}-wide "
                            f"rows")
        arr = raw.reshape(-1, vocab)
    arr = np.asarray(arr, dtype=np.float32)
    if arr.ndim != 2 or arr.shape[1] != vocab:
        raise ToolError(f"{path}: logits of shape {arr.shape}, expected [rows, {vocab}]")
    return arr


def rel_err(c, r):
    return float(np.max(np.abs(c.astype(np.float64) - r)) / max(np.max(np.abs(r)), 1e-30))


def make_case(case, work, args, tools):
    """Writes the case's checkpoint; returns its directory."""
    kind, _, name = case.partition(":")
    out = os.path.join(work, case.replace(":", "_"))
    if kind == "mk":
        run(fill(MKMODEL_CMD, mkmodel=tools["mkmodel"], config=name, out=out, seed=args.seed),
            f"di-mkmodel {name}")
    elif kind == "ref" and name in ("plain", "perturbed"):
        make_ref_model.make(out, seed=args.seed, recipe=name,
                            token_map="random" if name == "perturbed" else "identity")
    else:
        raise ToolError(f"unknown case {case!r} (mk:NAME or ref:plain|perturbed)")
    return out


def compare_case(case, work, args, tools):
    """Returns a result dict: worst prefill/decode relative errors and agreement facts."""
    model_dir = make_case(case, work, args, tools)
    model = ref.Model(model_dir)
    vocab = model.cfg.vocab_size
    rng = np.random.default_rng(args.seed + 1)
    ids = [int(v) for v in rng.integers(3, vocab, args.prompt_len + args.decode_len)]
    prompt, teacher = ids[:args.prompt_len], ids[args.prompt_len:]
    dump = os.path.join(work, case.replace(":", "_") + ".logits")
    run(fill(GENERATE_CMD, generate=tools["generate"], model=model_dir,
             ids=",".join(map(str, prompt)), teacher=",".join(map(str, teacher)), dump=dump),
        f"di-generate on {case}")
    c_rows = read_dump(dump, vocab)
    r_all = model.forward(ids).astype(np.float64)
    first = args.prompt_len - 1                      # row 0 = prefill of the last prompt token
    n = min(len(c_rows), len(ids) - first)
    if n < 1 + min(1, args.decode_len):
        raise ToolError(f"{dump}: {len(c_rows)} rows, expected {1 + args.decode_len}")
    errs = [rel_err(c_rows[i], r_all[first + i]) for i in range(n)]
    argmax_same = [int(np.argmax(c_rows[i])) == int(np.argmax(r_all[first + i]))
                   for i in range(n)]
    dec = errs[1:]
    return {"case": case, "rows": n, "expected_rows": 1 + args.decode_len,
            "prefill": errs[0], "decode": max(dec) if dec else 0.0,
            "decode_worst_pos": first + 1 + int(np.argmax(dec)) if dec else None,
            "argmax_agree": sum(argmax_same), "ok": max(errs) <= args.tol
            and n == 1 + args.decode_len}


def main(argv=None):
    ap = argparse.ArgumentParser(prog="compare.py", description="Compare di-generate's logits "
                                 "with the NumPy reference (v41_ref.py).")
    ap.add_argument("--cases", default=DEFAULT_CASES, help=f"comma-separated (default "
                    f"{DEFAULT_CASES})")
    ap.add_argument("--prompt-len", type=int, default=160, help="prompt tokens (default 160)")
    ap.add_argument("--decode-len", type=int, default=24,
                    help="teacher-forced decode tokens (default 24)")
    ap.add_argument("--seed", type=int, default=0, help="weights and ids seed (default 0)")
    ap.add_argument("--tol", type=float, default=1e-4, help="max relative error (default 1e-4)")
    ap.add_argument("--keep", help="work directory to keep (default: a temporary one)")
    ap.add_argument("--mkmodel", help="di-mkmodel binary (default: from DI_BUILD_ROOT)")
    ap.add_argument("--generate", help="di-generate binary (default: from DI_BUILD_ROOT)")
    ap.add_argument("--json", action="store_true", help="print the results as JSON")
    args = ap.parse_args(argv)
    if args.prompt_len < 1 or args.decode_len < 0:
        ap.error("--prompt-len must be >= 1 and --decode-len >= 0")
    cases = [c for c in args.cases.split(",") if c]
    tmp = None
    work = args.keep
    if work:
        os.makedirs(work, exist_ok=True)
    else:
        tmp = tempfile.TemporaryDirectory()
        work = tmp.name
    results, status = [], 0
    try:
        tools = {"generate": locate("generate", args.generate)}
        if any(c.startswith("mk:") for c in cases):
            tools["mkmodel"] = locate("mkmodel", args.mkmodel)
        for case in cases:
            print(f"compare.py: {case} ...", file=sys.stderr)
            res = compare_case(case, work, args, tools)
            results.append(res)
            if not res["ok"]:
                status = max(status, 1)
    except (ToolError, ref.RefError, subprocess.TimeoutExpired) as e:
        print(f"compare.py: error: {e}", file=sys.stderr)
        status = 2
    finally:
        if tmp:
            tmp.cleanup()
    if args.json:
        json.dump(results, sys.stdout, indent=1)
        print()
    else:
        print(f"{'case':16} {'rows':>5} {'prefill rel':>12} {'decode rel':>12} {'at pos':>7} "
              f"{'argmax':>7}  result")
        for r in results:
            print(f"{r['case']:16} {r['rows']:>5} {r['prefill']:12.3e} {r['decode']:12.3e} "
                  f"{str(r['decode_worst_pos']):>7} {r['argmax_agree']:>3}/{r['rows']:<3}  "
                  f"{'ok' if r['ok'] else 'FAIL (tol %.0e)' % args.tol}")
    return status


if __name__ == "__main__":
    sys.exit(main())
