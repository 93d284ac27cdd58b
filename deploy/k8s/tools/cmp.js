// Compares two rendered YAML streams object by object; prints the first differing path of each.
// usage: node cmp.js A.yaml B.yaml  (exit 1 when they differ)
'use strict';
const YAML = require('yaml');
const fs = require('fs');
const load = (f) => YAML.parseAllDocuments(fs.readFileSync(f, 'utf8'), { version: '1.1' })
  .map((d) => d.toJS()).filter(Boolean);
const key = (o) => `${o.kind}/${o.metadata.name}`;
// lists whose order means nothing to Kubernetes (kustomize may move a patched item first)
const UNORDERED = { volumes: 'name', volumeMounts: 'mountPath', env: 'name' };
function byKey(v, k) {
  return Array.isArray(v) ? [...v].sort((x, y) => String(x[k]).localeCompare(String(y[k]))) : v;
}
function firstDiff(a, b, p) {
  const last = p.slice(p.lastIndexOf('.') + 1);
  if (UNORDERED[last]) { a = byKey(a, UNORDERED[last]); b = byKey(b, UNORDERED[last]); }
  if (typeof a !== typeof b || Array.isArray(a) !== Array.isArray(b) || (a === null) !== (b === null))
    return `${p}: ${JSON.stringify(a)} vs ${JSON.stringify(b)}`;
  if (a && typeof a === 'object') {
    const ks = new Set([...Object.keys(a), ...Object.keys(b)]);
    for (const k of ks) { const d = firstDiff(a[k], b[k], `${p}.${k}`); if (d) return d; }
    return null;
  }
  return a === b ? null : `${p}: ${JSON.stringify(a)} vs ${JSON.stringify(b)}`;
}
const A = new Map(load(process.argv[2]).map((o) => [key(o), o]));
const B = new Map(load(process.argv[3]).map((o) => [key(o), o]));
let bad = 0;
for (const k of new Set([...A.keys(), ...B.keys()])) {
  const d = firstDiff(A.get(k), B.get(k), k);
  if (d) { bad++; console.log(`differs: ${d}`); }
}
process.exit(bad ? 1 : 0);
