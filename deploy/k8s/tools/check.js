// Checks deploy/k8s and deploy/docker offline (deploy/k8s/check.sh runs it):
//   1. renders every overlay (render.js) into OUT/<overlay>.yaml;
//   2. validates every object against the Kubernetes OpenAPI schemas (kubernetes-models;
//      ServiceMonitor with @kubernetes-models/prometheus-operator); an unknown kind is an error;
//      a field that the built-in kinds do not declare is an error too (fields.js);
//   3. checks what the schemas cannot: every $(VAR) in args is defined; every flag and every
//      environment variable a container gets is in its binary's --help (library variables
//      UCX_* and NCCL_* excepted, and variables only used for $(VAR) in args); the engines'
//      world sizes equal their replicas; the router lists exactly the prefill and decode pods;
//      Services select pods and name ports that exist; probes name ports that exist; the grace
//      period covers --drain and the preStop pause; ConfigMaps referenced exist;
//   4. lints the Dockerfiles (dockerfile-utils) and checks their stages: non-root USER,
//      HEALTHCHECK, build steps that are the scripts CI runs.
// usage: node check.js --k8s DIR --docker DIR --context DIR --build BUILDDIR --out OUTDIR
// (--context: the image build context, the repository root)
// exit 0: all good; 1: a problem (each printed); 77: no problem, but a binary is not built
// (its flags could not be checked; each one named).
'use strict';
const fs = require('fs');
const path = require('path');
const { execFileSync } = require('child_process');
const YAML = require('yaml');
const { render, RenderError } = require('./render.js');
const { unknownFields } = require('./fields.js');

const BINARIES = {
  'di-kvstore': 'kvstore/di-kvstore',
  'di-kvctl': 'kvstore/di-kvctl',
  'di-router': 'router/di-router',
  'di-prefill': 'prefill/di-prefill',
  'di-decode': 'decode/di-decode',
  'di-mkmodel': 'tools/mkmodel/di-mkmodel',
};
const LIBRARY_ENV = /^(UCX|NCCL)_/;
const WORLD = { prefill: 'PREFILL_WORLD', decode: 'DECODE_WORLD' };

const problems = [];
const notBuilt = new Set();
const problem = (where, what) => problems.push(`${where}: ${what}`);

function args() {
  const a = {};
  const v = process.argv.slice(2);
  for (let i = 0; i < v.length; i += 2) {
    if (!['--k8s', '--docker', '--build', '--out', '--context'].includes(v[i]) || v[i + 1] === undefined) {
      process.stderr.write('usage: node check.js --k8s DIR --docker DIR --context DIR --build BUILDDIR --out OUTDIR\n');
      process.exit(2);
    }
    a[v[i].slice(2)] = v[i + 1];
  }
  for (const k of ['k8s', 'docker', 'build', 'out', 'context']) {
    if (!a[k]) { process.stderr.write(`check: --${k} is required\n`); process.exit(2); }
  }
  return a;
}

async function modelClass(o) {
  const [group, version] = o.apiVersion.includes('/') ? o.apiVersion.split('/') : [null, o.apiVersion];
  let mod;
  if (group === 'monitoring.coreos.com')
    mod = `@kubernetes-models/prometheus-operator/monitoring.coreos.com/${version}/${o.kind}`;
  else mod = `kubernetes-models/${group ? `${group}/` : ''}${version}/${o.kind}`;
  try {
    const m = await import(mod);
    return m[o.kind] || (m.default && m.default[o.kind]);
  } catch (e) {
    return null;
  }
}

const helpCache = new Map();
function helpOf(build, bin) {
  if (helpCache.has(bin)) return helpCache.get(bin);
  let h = null;
  const rel = BINARIES[bin];
  const exe = rel && path.join(build, rel);
  if (exe && fs.existsSync(exe)) {
    try {
      h = execFileSync(exe, ['--help'], { encoding: 'utf8', timeout: 20000 });
    } catch (e) {
      h = { error: `${bin} --help failed: ${(e.stderr || e.message).toString().split('\n')[0]}` };
    }
  }
  helpCache.set(bin, h);
  return h;
}

function helpFlags(help) {
  const flags = new Set();
  for (const m of help.matchAll(/^\s+(--[a-z0-9][a-z0-9-]*)/gm)) flags.add(m[1]);
  return flags;
}

function durationSeconds(s) {
  const m = /^(\d+(?:\.\d+)?)(ms|s|m|h|d)?$/.exec(s);
  if (!m) return null;
  const mult = { ms: 0.001, s: 1, m: 60, h: 3600, d: 86400 }[m[2] || 'ms'];
  return Number(m[1]) * mult;
}

function podSpecOf(o) {
  return o.spec && o.spec.template && o.spec.template.spec;
}

function checkContainers(where, o, objs, build) {
  const spec = podSpecOf(o);
  const configMaps = new Map(objs.filter((x) => x.kind === 'ConfigMap').map((x) => [x.metadata.name, x]));
  for (const c of [...(spec.initContainers || []), ...(spec.containers || [])]) {
    const cw = `${where} container ${c.name}`;
    const envNames = new Set((c.env || []).map((e) => e.name));
    for (const e of c.env || []) {
      const ref = e.valueFrom && e.valueFrom.configMapKeyRef;
      if (!ref) continue;
      const cm = configMaps.get(ref.name);
      if (!cm || !cm.data || !(ref.key in cm.data)) problem(cw, `${e.name} refers to ConfigMap ${ref.name} key ${ref.key}, which is not in the render`);
    }
    for (const ef of c.envFrom || []) {
      if (!ef.configMapRef) continue;
      const cm = configMaps.get(ef.configMapRef.name);
      if (!cm) { problem(cw, `envFrom ConfigMap ${ef.configMapRef.name} is not in the render`); continue; }
      for (const k of Object.keys(cm.data || {})) envNames.add(k);
    }
    const argv = [...(c.command || []), ...(c.args || [])];
    const substituted = new Set();
    for (const a of argv) {
      for (const m of String(a).matchAll(/\$\(([A-Za-z_][A-Za-z0-9_]*)\)/g)) {
        substituted.add(m[1]);
        if (!envNames.has(m[1])) problem(cw, `$(${m[1]}) in its arguments is not defined in its environment`);
      }
    }
    if (!c.command || !c.command.length) { problem(cw, 'no command (the image has no default one)'); continue; }
    const bin = path.basename(c.command[0]);
    if (!BINARIES[bin]) { if (!['sleep', 'test'].includes(bin)) problem(cw, `unknown binary ${bin}`); continue; }
    const help = helpOf(build, bin);
    if (help === null) { notBuilt.add(`${bin} (build/${BINARIES[bin]})`); continue; }
    if (help.error) { problem(cw, help.error); continue; }
    const flags = helpFlags(help);
    for (const a of c.args || []) {
      const s = String(a);
      if (!s.startsWith('--')) continue;
      const flag = s.split('=')[0];
      if (!flags.has(flag)) problem(cw, `${bin} has no flag ${flag} (not in its --help)`);
    }
    for (const name of envNames) {
      if (substituted.has(name) || LIBRARY_ENV.test(name)) continue;
      if (!new RegExp(`\\b${name}\\b`).test(help)) problem(cw, `${bin} does not read ${name} (not in its --help)`);
    }
  }
}

function argValues(c, flag) {
  const out = [];
  const a = c.args || [];
  for (let i = 0; i < a.length; i++) {
    if (a[i] === flag && i + 1 < a.length) out.push(String(a[i + 1]));
    else if (String(a[i]).startsWith(`${flag}=`)) out.push(String(a[i]).slice(flag.length + 1));
  }
  return out;
}

function checkTopology(where, objs) {
  const byKindName = (k, n) => objs.find((o) => o.kind === k && o.metadata.name === n);
  const engineCm = byKindName('ConfigMap', 'engine-config');
  const router = byKindName('Deployment', 'router');
  const rc = router && router.spec.template.spec.containers.find((c) => c.name === 'router');
  for (const [role, key] of Object.entries(WORLD)) {
    const ss = byKindName('StatefulSet', role);
    if (!ss) { problem(where, `no StatefulSet ${role}`); continue; }
    const replicas = ss.spec.replicas === undefined ? 1 : ss.spec.replicas;
    const world = engineCm && engineCm.data && engineCm.data[key];
    if (String(world) !== String(replicas))
      problem(where, `StatefulSet ${role} has ${replicas} replicas but engine-config ${key} is ${world}`);
    const c = ss.spec.template.spec.containers.find((x) => x.name === role);
    const port = c && c.ports && c.ports[0] && c.ports[0].containerPort;
    const want = [];
    for (let i = 0; i < replicas; i++) want.push(`${role}-${i}.${ss.spec.serviceName}:${port}`);
    if (rc) {
      const got = argValues(rc, `--${role}`);
      if (JSON.stringify(got) !== JSON.stringify(want))
        problem(where, `the router's --${role} list is [${got.join(', ')}], the ${role} pods are [${want.join(', ')}]`);
    }
    const svc = byKindName('Service', ss.spec.serviceName);
    if (!svc || svc.spec.clusterIP !== 'None')
      problem(where, `StatefulSet ${role}: its serviceName ${ss.spec.serviceName} is not a headless Service`);
  }
  if (!router) problem(where, 'no Deployment router');
}

function checkObject(where, o, objs) {
  const spec = podSpecOf(o);
  if (o.kind === 'Service' && o.spec.selector) {
    const pods = objs.filter((x) => podSpecOf(x) && Object.entries(o.spec.selector)
      .every(([k, v]) => (x.spec.template.metadata.labels || {})[k] === v));
    if (!pods.length) problem(where, 'selects no pod template');
    for (const p of o.spec.ports || []) {
      if (typeof p.targetPort !== 'string') continue;
      const named = pods.some((x) => podSpecOf(x).containers.some((c) => (c.ports || []).some((q) => q.name === p.targetPort)));
      if (!named) problem(where, `targetPort ${p.targetPort} is no container port of the pods it selects`);
    }
  }
  if (o.kind === 'PodDisruptionBudget') {
    const sel = o.spec.selector.matchLabels;
    if (!objs.some((x) => podSpecOf(x) && Object.entries(sel).every(([k, v]) => (x.spec.template.metadata.labels || {})[k] === v)))
      problem(where, 'selects no pod template');
  }
  if (!spec) return;
  const grace = spec.terminationGracePeriodSeconds === undefined ? 30 : spec.terminationGracePeriodSeconds;
  for (const c of spec.containers || []) {
    const names = new Set((c.ports || []).map((p) => p.name));
    for (const pr of ['startupProbe', 'readinessProbe', 'livenessProbe']) {
      const p = c[pr];
      if (!p) { if (pr !== 'startupProbe') problem(`${where} container ${c.name}`, `no ${pr}`); continue; }
      const port = (p.httpGet && p.httpGet.port) || (p.tcpSocket && p.tcpSocket.port) || (p.grpc && p.grpc.port);
      if (typeof port === 'string' && !names.has(port)) problem(`${where} container ${c.name}`, `${pr} names port ${port}, which it does not declare`);
    }
    const drain = argValues(c, '--drain').map(durationSeconds)[0];
    const pre = c.lifecycle && c.lifecycle.preStop && c.lifecycle.preStop.exec &&
      c.lifecycle.preStop.exec.command[0] === 'sleep' ? Number(c.lifecycle.preStop.exec.command[1]) : 0;
    if (drain !== undefined && drain !== null && grace < drain + pre + 5)
      problem(`${where} container ${c.name}`, `terminationGracePeriodSeconds ${grace} is shorter than --drain (${drain} s) + preStop (${pre} s) + 5 s`);
    const sc = c.securityContext || {};
    if (sc.allowPrivilegeEscalation !== false || !(spec.securityContext || {}).runAsNonRoot)
      problem(`${where} container ${c.name}`, 'must run as non-root without privilege escalation');
  }
}

async function checkK8s(a) {
  const overlaysDir = path.join(a.k8s, 'overlays');
  const overlays = fs.readdirSync(overlaysDir).filter((d) => fs.existsSync(path.join(overlaysDir, d, 'kustomization.yaml'))).sort();
  if (!overlays.length) problem(overlaysDir, 'no overlay');
  fs.mkdirSync(a.out, { recursive: true });
  for (const ov of overlays) {
    let objs;
    try {
      objs = render(path.join(overlaysDir, ov));
    } catch (e) {
      if (!(e instanceof RenderError)) throw e;
      problem(ov, `does not render: ${e.message}`);
      continue;
    }
    const file = path.join(a.out, `${ov}.yaml`);
    fs.writeFileSync(file, objs.map((o) => YAML.stringify(o, { lineWidth: 0, version: '1.1' })).join('---\n'));
    let valid = 0;
    for (const o of objs) {
      const where = `${ov}: ${o.kind}/${o.metadata && o.metadata.name}`;
      const Cls = await modelClass(o);
      if (!Cls) { problem(where, `no schema for ${o.apiVersion} ${o.kind}`); continue; }
      try {
        new Cls(o).validate();
        valid++;
      } catch (e) {
        problem(where, `invalid: ${e.message}`);
        continue;
      }
      for (const u of unknownFields(o, __dirname) || []) problem(where, u);
      checkObject(where, o, objs);
      if (podSpecOf(o)) checkContainers(where, o, objs, a.build);
    }
    checkTopology(ov, objs);
    console.log(`k8s: ${ov}: ${objs.length} objects rendered into ${file}, ${valid} valid against the schemas`);
  }
}

function checkDocker(a) {
  const du = require('dockerfile-utils');
  const files = fs.readdirSync(a.docker).filter((f) => /^Dockerfile/.test(f)).sort();
  if (!files.length) problem(a.docker, 'no Dockerfile');
  for (const f of files) {
    const p = path.join(a.docker, f);
    const text = fs.readFileSync(p, 'utf8');
    for (const d of du.validate(text)) {
      problem(`${p}:${d.range.start.line + 1}`, `${d.message} (dockerfile-utils, severity ${d.severity})`);
    }
    // every COPY source (from the build context, the repository root) exists
    const context = a.context;
    for (const m of text.matchAll(/^COPY\s+(?!--from)(.+)$/gm)) {
      const words = m[1].trim().split(/\s+/).filter((w) => !w.startsWith('--'));
      for (const src of words.slice(0, -1)) {
        if (/[*?[]/.test(src) || src === '.') continue;
        if (!fs.existsSync(path.join(context, src))) problem(p, `COPY ${src}: not in the build context`);
      }
    }
    const stages = text.split(/^FROM\s/m).slice(1);
    if (stages.length < 2) { problem(p, 'is not multi-stage (a build stage and a runtime stage)'); continue; }
    const build = stages[0];
    const runtime = stages[stages.length - 1];
    if (!/deploy\/local\/install-deps\.sh/.test(build)) problem(p, 'the build stage does not run deploy/local/install-deps.sh (the script CI runs)');
    if (!/deploy\/docker\/build\.sh/.test(build)) problem(p, 'the build stage does not run deploy/docker/build.sh');
    const user = [...runtime.matchAll(/^USER\s+(\S+)/gm)].pop();
    if (!user || /^(root|0)(:|$)/.test(user[1])) problem(p, 'the runtime stage does not end as a non-root USER');
    if (!/^HEALTHCHECK\s+/m.test(runtime)) problem(p, 'the runtime stage has no HEALTHCHECK');
    if (/install-deps\.sh|build-essential|-dev\b/.test(runtime)) problem(p, 'the runtime stage installs build tools or -dev packages');
    console.log(`docker: ${f}: ${stages.length} stages, lint clean, non-root, HEALTHCHECK`);
  }
}

(async () => {
  const a = args();
  await checkK8s(a);
  checkDocker(a);
  for (const p of problems) console.log(`problem: ${p}`);
  for (const b of notBuilt) console.log(`not built: ${b}: its flags and environment were not checked`);
  if (problems.length) { console.log(`check: ${problems.length} problem(s)`); process.exit(1); }
  if (notBuilt.size) { console.log('check: no problem found, but not every binary is built (exit 77)'); process.exit(77); }
  console.log('check: every overlay renders and validates; every flag and variable is in its binary\'s --help');
})().catch((e) => { console.error(`check: ${e.stack}`); process.exit(1); });
