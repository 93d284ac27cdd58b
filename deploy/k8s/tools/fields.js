// Unknown fields: the OpenAPI schemas accept any extra key, so a misspelt field
// (`terminationGracePeriodSecond`) would validate and be dropped by the API server. This walks
// an object along the type declarations of kubernetes-models (the same OpenAPI definitions, as
// TypeScript interfaces) and names every key that its type does not declare.
'use strict';
const fs = require('fs');
const path = require('path');

const parsed = new Map(); // .d.ts path -> its interface as a parsed type, or null

function packageDir(name, from) {
  for (let dir = from; ; dir = path.dirname(dir)) {
    const cand = path.join(dir, 'node_modules', name);
    if (fs.existsSync(path.join(cand, 'package.json'))) return cand;
    if (dir === path.dirname(dir)) return null;
  }
}

function resolveImport(spec, fromFile) {
  const dir = path.dirname(fromFile);
  if (spec.startsWith('.')) return path.resolve(dir, `${spec}.d.ts`);
  const parts = spec.split('/');
  const n = spec.startsWith('@') ? 2 : 1;
  const pkg = packageDir(parts.slice(0, n).join('/'), dir);
  return pkg ? path.join(pkg, ...parts.slice(n)) + '.d.ts' : null;
}

// A small parser of the TypeScript type expressions these declarations use: object literals,
// Array<T>, index signatures { [key: string]: T }, unions, named (imported) interfaces.
function parseType(toks, st, imports) {
  const peek = () => toks[st.i];
  const next = () => toks[st.i++];
  const expect = (t) => { if (next() !== t) throw new Error(`expected ${t}`); };
  function primary() {
    const t = next();
    if (t === '{') {
      if (peek() === '[') {
        next(); next(); expect(':'); next(); expect(']'); expect(':');
        const of = union();
        if (peek() === ';') next();
        expect('}');
        return { kind: 'map', of };
      }
      const props = new Map();
      while (peek() !== '}') {
        let key = next();
        if (key.startsWith('"')) key = key.slice(1, -1);
        if (peek() === '?') next();
        expect(':');
        props.set(key, union());
        if (peek() === ';' || peek() === ',') next();
      }
      next();
      return { kind: 'obj', props };
    }
    if (t === '(') { const u = union(); expect(')'); return u; }
    if (t === 'Array' && peek() === '<') { next(); const of = union(); expect('>'); return { kind: 'list', of }; }
    if (imports.has(t)) return { kind: 'ref', file: imports.get(t) };
    return { kind: 'leaf' };
  }
  function union() {
    let t = primary();
    while (peek() === '[' && toks[st.i + 1] === ']') { st.i += 2; t = { kind: 'list', of: t }; }
    if (peek() !== '|') return t;
    while (peek() === '|') { next(); primary(); }
    return { kind: 'leaf' };
  }
  return union();
}

function parse(file) {
  if (parsed.has(file)) return parsed.get(file);
  let info = null;
  if (file && fs.existsSync(file)) {
    const text = fs.readFileSync(file, 'utf8').replace(/\/\*[\s\S]*?\*\//g, '');
    const imports = new Map();
    for (const m of text.matchAll(/^import \{ ([^}]+) \} from "([^"]+)";/gm)) {
      const target = resolveImport(m[2], file);
      for (const id of m[1].split(',')) imports.set(id.trim(), target);
    }
    const head = /^export interface I\w+(?: extends [^{]+)? (?=\{)/m.exec(text);
    if (head) {
      const toks = text.slice(head.index + head[0].length).match(/"[^"]*"|[\w$.]+|[{}<>[\]:;?|(),]/g);
      info = parseType(toks, { i: 0 }, imports);
    }
  }
  parsed.set(file, info);
  return info;
}

function walk(value, type, where, out) {
  if (!type || value === null || typeof value !== 'object') return;
  if (type.kind === 'ref') return walk(value, parse(type.file), where, out);
  if (type.kind === 'list' && Array.isArray(value)) value.forEach((x, i) => walk(x, type.of, `${where}[${i}]`, out));
  else if (type.kind === 'map' && !Array.isArray(value)) for (const [k, v] of Object.entries(value)) walk(v, type.of, `${where}.${k}`, out);
  else if (type.kind === 'obj' && !Array.isArray(value)) {
    for (const [k, v] of Object.entries(value)) {
      if (!type.props.has(k)) out.push(`${where}.${k}: unknown field`);
      else walk(v, type.props.get(k), `${where}.${k}`, out);
    }
  }
}

// Returns the unknown fields of a built-in object ([] when all are known), or null when its
// kind has no declaration here (custom resources).
function unknownFields(o, toolsDir) {
  const [group, version] = o.apiVersion.includes('/') ? o.apiVersion.split('/') : [null, o.apiVersion];
  const pkg = packageDir('kubernetes-models', toolsDir);
  const file = path.join(pkg, ...(group ? [group] : []), version, `${o.kind}.d.ts`);
  const type = parse(file);
  if (!type) return null;
  const out = [];
  const { apiVersion, kind, ...rest } = o;
  walk(rest, type, o.kind, out);
  return out;
}

module.exports = { unknownFields };
