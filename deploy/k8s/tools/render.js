// Renders a Kustomize directory offline, for the subset deploy/k8s uses:
//   resources (files and directories holding a kustomization.yaml), namespace,
//   labels (pairs added to metadata.labels), images (newName/newTag),
//   configMapGenerator (literals, files, envs; behavior create|merge|replace) with
//   generatorOptions.disableNameSuffixHash: true, and patches (path: a strategic merge
//   patch matched by kind and name).
// Anything else in a kustomization.yaml is an error, so a file that real kustomize would render
// differently is refused rather than rendered wrong.
//
// usage: node render.js DIR            prints the YAML stream on stdout
'use strict';
const fs = require('fs');
const path = require('path');
const YAML = require('yaml');

const KNOWN = new Set(['apiVersion', 'kind', 'resources', 'namespace', 'labels', 'images',
  'configMapGenerator', 'generatorOptions', 'patches']);
const CLUSTER_SCOPED = new Set(['Namespace', 'ClusterRole', 'ClusterRoleBinding',
  'PersistentVolume', 'StorageClass', 'CustomResourceDefinition', 'PriorityClass']);
// strategic merge keys of the lists we patch (the rest are replaced, as Kubernetes does)
const MERGE_KEYS = {
  containers: 'name', initContainers: 'name', env: 'name', volumes: 'name',
  volumeMounts: 'mountPath', ports: 'containerPort', volumeClaimTemplates: null,
  topologySpreadConstraints: ['topologyKey', 'whenUnsatisfiable'], imagePullSecrets: 'name',
};

class RenderError extends Error {}

function readYamlDocs(file) {
  if (!fs.existsSync(file)) throw new RenderError(`${file} does not exist`);
  const text = fs.readFileSync(file, 'utf8');
  const docs = YAML.parseAllDocuments(text, { version: '1.1' }); // as kubectl reads it
  const out = [];
  for (const d of docs) {
    if (d.errors.length) throw new RenderError(`${file}: ${d.errors[0].message}`);
    const v = d.toJS();
    if (v !== null && v !== undefined) out.push(v);
  }
  return out;
}

function isObj(v) { return v !== null && typeof v === 'object' && !Array.isArray(v); }

function merge(base, patch, key) {
  if (isObj(base) && isObj(patch)) {
    if (patch.$patch === 'replace') { const p = { ...patch }; delete p.$patch; return p; }
    const out = { ...base };
    for (const [k, v] of Object.entries(patch)) {
      if (v === null) delete out[k];
      else if (k in out) out[k] = merge(out[k], v, k);
      else out[k] = v;
    }
    return out;
  }
  if (Array.isArray(base) && Array.isArray(patch) && MERGE_KEYS[key]) {
    const mk = [].concat(MERGE_KEYS[key]);
    const same = (x, y) => isObj(x) && mk.every((k) => x[k] === y[k]);
    const out = base.map((x) => x);
    for (const item of patch) {
      if (!isObj(item) || !(mk[0] in item)) throw new RenderError(`a patch item of ${key} has no ${mk[0]}`);
      const i = out.findIndex((x) => same(x, item));
      if (item.$patch === 'delete') { if (i >= 0) out.splice(i, 1); continue; }
      if (i >= 0) out[i] = merge(out[i], item, null);
      else out.push(item);
    }
    return out;
  }
  return patch;
}

function parseEnvFile(file) {
  const out = {};
  for (const raw of fs.readFileSync(file, 'utf8').split('\n')) {
    const line = raw.trim();
    if (!line || line.startsWith('#')) continue;
    const eq = line.indexOf('=');
    if (eq <= 0) throw new RenderError(`${file}: "${line}" is not KEY=VALUE`);
    out[line.slice(0, eq)] = line.slice(eq + 1);
  }
  return out;
}

function generateConfigMap(dir, g) {
  for (const k of Object.keys(g)) {
    if (!['name', 'literals', 'files', 'envs', 'behavior', 'options'].includes(k))
      throw new RenderError(`${dir}: configMapGenerator field ${k} is not supported`);
  }
  const data = {};
  for (const lit of g.literals || []) {
    const eq = lit.indexOf('=');
    if (eq <= 0) throw new RenderError(`${dir}: literal "${lit}" is not KEY=VALUE`);
    data[lit.slice(0, eq)] = lit.slice(eq + 1);
  }
  for (const f of g.files || []) {
    const eq = f.indexOf('=');
    const key = eq > 0 ? f.slice(0, eq) : path.basename(f);
    const rel = eq > 0 ? f.slice(eq + 1) : f;
    const abs = path.resolve(dir, rel);
    if (!abs.startsWith(path.resolve(dir) + path.sep))
      throw new RenderError(`${dir}: ${rel} is outside the kustomization directory`);
    data[key] = fs.readFileSync(abs, 'utf8');
  }
  for (const f of g.envs || []) Object.assign(data, parseEnvFile(path.resolve(dir, f)));
  const cm = { apiVersion: 'v1', kind: 'ConfigMap', metadata: { name: g.name }, data };
  if (g.options && g.options.labels) cm.metadata.labels = { ...g.options.labels };
  if (g.options && g.options.annotations) cm.metadata.annotations = { ...g.options.annotations };
  return cm;
}

function idOf(o) { return `${o.kind}/${o.metadata && o.metadata.name}`; }

function render(dir, seen = new Set()) {
  const kfile = path.join(dir, 'kustomization.yaml');
  if (!fs.existsSync(kfile)) throw new RenderError(`${dir}: no kustomization.yaml`);
  const real = fs.realpathSync(dir);
  if (seen.has(real)) throw new RenderError(`${dir}: included twice (a cycle?)`);
  seen.add(real);
  const [k] = readYamlDocs(kfile);
  for (const key of Object.keys(k)) {
    if (!KNOWN.has(key)) throw new RenderError(`${kfile}: field ${key} is not supported by this renderer`);
  }
  if (k.kind !== 'Kustomization') throw new RenderError(`${kfile}: kind must be Kustomization`);
  let objs = [];
  for (const r of k.resources || []) {
    const p = path.resolve(dir, r);
    if (!fs.existsSync(p)) throw new RenderError(`${kfile}: resource ${r} does not exist`);
    if (fs.statSync(p).isDirectory()) objs.push(...render(p, seen));
    else objs.push(...readYamlDocs(p));
  }
  const gopts = k.generatorOptions || {};
  for (const g of k.configMapGenerator || []) {
    if (gopts.disableNameSuffixHash !== true && !(g.options && g.options.disableNameSuffixHash))
      throw new RenderError(`${kfile}: set generatorOptions.disableNameSuffixHash: true (name hashes are not supported)`);
    const cm = generateConfigMap(dir, g);
    if (gopts.labels) cm.metadata.labels = { ...gopts.labels, ...(cm.metadata.labels || {}) };
    const behavior = g.behavior || 'create';
    const i = objs.findIndex((o) => o.kind === 'ConfigMap' && o.metadata.name === g.name);
    if (behavior === 'create') {
      if (i >= 0) throw new RenderError(`${kfile}: ConfigMap ${g.name} already exists (use behavior: merge)`);
      objs.push(cm);
    } else if (behavior === 'merge' || behavior === 'replace') {
      if (i < 0) throw new RenderError(`${kfile}: ConfigMap ${g.name} to ${behavior} does not exist`);
      objs[i] = behavior === 'merge' ? merge(objs[i], cm, null) : cm;
    } else throw new RenderError(`${kfile}: behavior ${behavior} is not create, merge or replace`);
  }
  for (const p of k.patches || []) {
    if (!p.path || Object.keys(p).some((x) => x !== 'path'))
      throw new RenderError(`${kfile}: only patches given by path (strategic merge) are supported`);
    for (const patch of readYamlDocs(path.resolve(dir, p.path))) {
      const i = objs.findIndex((o) => o.kind === patch.kind && o.metadata.name === patch.metadata.name);
      if (i < 0) throw new RenderError(`${p.path}: patch target ${idOf(patch)} is not among the resources`);
      objs[i] = merge(objs[i], patch, null);
    }
  }
  if (k.namespace) {
    for (const o of objs) {
      if (CLUSTER_SCOPED.has(o.kind)) continue;
      o.metadata = { ...o.metadata, namespace: k.namespace };
    }
  }
  for (const l of k.labels || []) {
    if (Object.keys(l).some((x) => x !== 'pairs'))
      throw new RenderError(`${kfile}: labels support only pairs (no selectors or templates)`);
    for (const o of objs) o.metadata.labels = { ...(o.metadata.labels || {}), ...l.pairs };
  }
  for (const im of k.images || []) {
    if (!isObj(im) || typeof im.name !== 'string') throw new RenderError(`${kfile}: an images entry is not {name, newName, newTag}`);
    for (const o of objs) {
      const spec = o.spec && o.spec.template && o.spec.template.spec;
      if (!spec) continue;
      for (const c of [...(spec.containers || []), ...(spec.initContainers || [])]) {
        const [name, tag] = splitImage(c.image);
        if (name !== im.name) continue;
        c.image = `${im.newName || name}:${im.newTag || tag || 'latest'}`;
      }
    }
  }
  const ids = new Set();
  for (const o of objs) {
    const id = `${o.apiVersion} ${idOf(o)} ${o.metadata.namespace || ''}`;
    if (ids.has(id)) throw new RenderError(`${kfile}: ${id} is defined twice`);
    ids.add(id);
  }
  return objs;
}

function splitImage(img) {
  const slash = img.lastIndexOf('/');
  const colon = img.lastIndexOf(':');
  if (colon > slash) return [img.slice(0, colon), img.slice(colon + 1)];
  return [img, null];
}

module.exports = { render, RenderError };

if (require.main === module) {
  if (process.argv.length !== 3 || process.argv[2] === '--help') {
    process.stdout.write('usage: node render.js DIR  (prints the rendered YAML stream)\n');
    process.exit(process.argv[2] === '--help' ? 0 : 2);
  }
  try {
    const objs = render(path.resolve(process.argv[2]));
    process.stdout.write(objs.map((o) => YAML.stringify(o, { lineWidth: 0, version: '1.1' })).join('---\n'));
  } catch (e) {
    if (!(e instanceof RenderError) && e.code !== 'ENOENT') throw e;
    process.stderr.write(`render: ${e.message}\n`);
    process.exit(1);
  }
}
