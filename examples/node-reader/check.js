'use strict';
// What a reader checks before it uses any field of a manifest (docs/spec.md#conformance), in order:
//   1. the format-version gate (spec.md#versioning): another major stops everything (CK003);
//   2. the JSON Schema of the document's own version (1.0 or 1.1; a newer minor: 1.1, whose
//      unknown keys are tolerated, CK004), with ajv (draft 2020-12);
//   3. the semantic rules CK101-CK126 (docs/errors.md), which the schema cannot express.
// Each finding is {code, where, message, hint, severity}; the codes are ckptspec's.
const fs = require('fs');
const path = require('path');
const Ajv2020 = require('ajv/dist/2020');
const { ITEMSIZE } = require('./dtypes');

const SCHEMA_DIR = path.join(__dirname, '..', '..', 'schema');
const SCHEMA_FILES = {
  '1.0': path.join(SCHEMA_DIR, 'manifest-1.0.schema.json'),
  '1.1': path.join(SCHEMA_DIR, 'manifest-1.1.schema.json'),
};
const SCHEMA_FILE = SCHEMA_FILES['1.1'];
const READER = { major: 1, minor: 1 };
const SEMVER = /^(0|[1-9][0-9]{0,5})\.(0|[1-9][0-9]{0,5})\.(0|[1-9][0-9]{0,5})$/;

const finding = (code, where, message, hint, severity = 'error') => ({ code, where, message, hint, severity });

// A key as ckptspec quotes it in a path (Python's repr of a string): 'a.pt', "it's".
function quoted(key) {
  const q = key.includes("'") && !key.includes('"') ? '"' : "'";
  const body = key.replace(/\\/g, '\\\\').replace(/\n/g, '\\n').replace(/\r/g, '\\r').replace(/\t/g, '\\t');
  return q + (q === "'" ? body.replace(/'/g, "\\'") : body) + q;
}

// ["groups", 0, "numel"] -> "$.groups[0].numel", ["file_ranks", "a.pt"] -> "$.file_ranks['a.pt']" (the paths ckptspec prints).
function jsonPath(parts) {
  return '$' + parts.map((p) => (typeof p === 'number' ? `[${p}]`
    : /^[A-Za-z_][A-Za-z0-9_]*$/.test(p) ? `.${p}` : `[${quoted(p)}]`)).join('');
}

// strict: any keyword ajv does not know, or an ambiguous type, is an error; warnings are collected.
function compileSchema(file = SCHEMA_FILE, warnings = []) {
  const note = (...args) => warnings.push(args.join(' '));
  const ajv = new Ajv2020({ strict: true, allErrors: true, logger: { log: note, warn: note, error: note } });
  return ajv.compile(JSON.parse(fs.readFileSync(file, 'utf8')));
}

// Every shipped schema, by MAJOR.MINOR; `file` (tests: a sloppy schema) stands for all of them. `lazy`: see byVersion.
function compileSchemas(file = null, warnings = [], lazy = false) {
  if (file) return { '*': compileSchema(file, warnings) };
  return byVersion(SCHEMA_FILES, (f) => compileSchema(f, warnings), lazy);
}

// {MAJOR.MINOR: schema file} -> {MAJOR.MINOR: its compiled validator}, each compiled now, or with `lazy` when a
// document of that version first asks (the reader, which checks one document: compiling the schemas of the
// versions it does not have was half its start-up). Lazy, a schema's compile warnings come at its first use.
function byVersion(files, compile, lazy) {
  if (!lazy) return Object.fromEntries(Object.entries(files).map(([v, f]) => [v, compile(f)]));
  const validators = {};
  for (const [v, f] of Object.entries(files)) {
    let compiled;
    Object.defineProperty(validators, v, { enumerable: true, get: () => (compiled ??= compile(f)) });
  }
  return validators;
}

// A document is checked against the schema of its own version (a 1.0 document may not carry 1.1's
// fields); a newer minor, or a malformed version, against the latest.
function schemaFor(validators, doc) {
  if (typeof validators === 'function') return validators;
  if (validators['*']) return validators['*'];
  const version = doc !== null && typeof doc === 'object' ? doc.format_version : undefined;
  const line = typeof version === 'string' && SEMVER.test(version) ? version.split('.').slice(0, 2).join('.') : null;
  return validators[line] ?? validators[`${READER.major}.${READER.minor}`];
}

function versionGate(doc) {
  const version = doc !== null && typeof doc === 'object' ? doc.format_version : undefined;
  if (typeof version !== 'string' || !SEMVER.test(version)) return { findings: [], stop: false, newerMinor: false };
  const [major, minor] = version.split('.').map(Number);
  if (major !== READER.major) {
    return { stop: true, newerMinor: false, findings: [finding('CK003', '$.format_version',
      `format version ${version} has major ${major}; this reader understands major ${READER.major} only`,
      'use a reader for that major version, or `ckptspec migrate` the manifest')] };
  }
  if (minor > READER.minor) {
    return { stop: false, newerMinor: true, findings: [finding('CK004', '$.format_version',
      `format version ${version} is newer than ${READER.major}.${READER.minor}; unknown fields are ignored`,
      'a newer reader checks every field', 'warning')] };
  }
  return { findings: [], stop: false, newerMinor: false };
}

// JSON.parse turns numbers into doubles: above 2^53 - 1 an integer may have been rounded, and
// 2^63 (one past the schema's maximum) reads as the same double as 2^63 - 1. Refuse those.
function unsafeIntegers(value, parts = [], out = []) {
  if (typeof value === 'number' && Math.abs(value) > Number.MAX_SAFE_INTEGER) {
    out.push(finding('CK001', jsonPath(parts), `${value} is beyond 2^53 - 1: a JavaScript reader cannot check it exactly`,
      'counts above 2^53 - 1 are refused by this reader'));
  } else if (value !== null && typeof value === 'object') {
    for (const [k, v] of Object.entries(value)) unsafeIntegers(v, [...parts, Array.isArray(value) ? Number(k) : k], out);
  }
  return out;
}

function schemaFindings(validate, doc, newerMinor) {
  if (validate(doc)) return [];
  return validate.errors
    .filter((e) => !(newerMinor && e.keyword === 'additionalProperties'))
    .map((e) => {
      const parts = e.instancePath.split('/').slice(1).map((s) => s.replace(/~1/g, '/').replace(/~0/g, '~'))
        .map((s) => (/^(0|[1-9][0-9]*)$/.test(s) ? Number(s) : s));
      const detail = e.keyword === 'additionalProperties' ? ` (${JSON.stringify(e.params.additionalProperty)})` : '';
      return finding('CK001', jsonPath(parts), `${e.message}${detail}`, `the document breaks the JSON Schema rule '${e.keyword}'`);
    });
}

// ---- semantic rules (docs/errors.md); they assume a schema-valid document

const product = (shape) => shape.reduce((a, d) => a * BigInt(d), 1n);
const lastEnd = (params) => (params.length ? params.at(-1).offset + params.at(-1).numel + params.at(-1).padding : 0);
const roundUp = (v, m) => Math.ceil(v / m) * m;
const sameShape = (a, b) => a.length === b.length && a.every((d, i) => d === b[i]);

function tensorRules(m, add) {
  const params = m.groups.flatMap((g, gi) => g.params.map((p, pi) => [p, ['groups', gi, 'params', pi]]));
  // CK101: numel is the product of the shape ([] holds one element).
  for (const [t, where] of [...params, ...m.frozen.map((f, i) => [f, ['frozen', i]])]) {
    if (product(t.shape) !== BigInt(t.numel)) {
      add('CK101', [...where, 'numel'], `${t.name}: numel ${t.numel} is not the product of shape [${t.shape}]`,
        'numel must be the product of the shape ([] holds 1)');
    }
  }
  // CK102: a name has one role (trainable, frozen, buffer, alias or excluded).
  const seen = new Set();
  const sections = ['frozen', 'buffers', 'aliases', 'excluded'];
  const named = [...params, ...sections.flatMap((s) => m[s].map((t, i) => [t, [s, i]]))];
  for (const [t, where] of named) {
    if (seen.has(t.name)) add('CK102', [...where, 'name'], `${JSON.stringify(t.name)} is declared twice`, 'a name has exactly one role');
    seen.add(t.name);
  }
  // CK103-CK105: an alias points straight at a tensor of its own shape.
  const owners = new Map([...params.map(([p]) => p), ...m.frozen, ...m.buffers].map((t) => [t.name, t.shape]));
  const aliases = new Set(m.aliases.map((a) => a.name));
  m.aliases.forEach((a, i) => {
    if (!owners.has(a.owner) && !aliases.has(a.owner)) {
      add('CK103', ['aliases', i, 'owner'], `alias ${a.name} points to undeclared ${a.owner}`, 'the owner must be a parameter or buffer');
    }
    if (aliases.has(a.owner) || a.owner === a.name) {
      add('CK104', ['aliases', i, 'owner'], `alias ${a.name} points to the alias ${a.owner}`,
        'point every alias at the tensor that owns the storage');
    }
    if (owners.has(a.owner) && !sameShape(owners.get(a.owner), a.shape)) {
      add('CK105', ['aliases', i, 'shape'], `alias ${a.name} has shape [${a.shape}], its owner [${owners.get(a.owner)}]`,
        'a tied tensor has its owner\'s shape');
    }
  });
}

// spec.md#partition-arithmetic: the equations that place every element.
function groupRules(m, add) {
  const { zero_stage: stage, world_size: worldSize } = m.layout;
  m.groups.forEach((g, gi) => {
    const at = (...parts) => ['groups', gi, ...parts];
    const P = g.partition_count;
    const perParam = g.partitioning === 'per_param';
    // CK111, CK112: the partitioning and the rank count follow the stage and the world size.
    if (g.partitioning !== (stage === 3 ? 'per_param' : 'flat')) {
      add('CK111', at('partitioning'), `stage ${stage} does not use ${g.partitioning} partitioning`,
        'stage 3 is per_param, stages 0-2 flat');
    }
    if (stage === 0 && P !== 1) add('CK111', at('partition_count'), 'stage 0 does not partition', 'use partition_count 1');
    if (stage !== 0 && P !== worldSize) {
      add('CK112', at('partition_count'), `partition_count ${P}, world_size ${worldSize}`, 'a group is partitioned over every rank');
    }
    if (g.saved_numels.length !== P) {
      add('CK112', at('saved_numels'), `${g.saved_numels.length} saved_numels for ${P} partitions`, 'one saved numel per rank');
    }
    // CK110: stage 1/2 flat groups align to 2 x partition_count (DeepSpeed's nccl_start_alignment_factor).
    const alignment = !perParam && (stage === 1 || stage === 2) ? 2 * P : 1;
    if (g.alignment !== alignment) add('CK110', at('alignment'), `alignment ${g.alignment}, expected ${alignment}`, 'see spec.md#groups');
    // CK109 padding, CK106 offsets: params lie back to back in the listed order.
    let next = 0;
    g.params.forEach((p, pi) => {
      const badPadding = perParam ? p.padding !== (P - (p.numel % P)) % P : p.padding && !m.layout.parameter_alignment;
      if (badPadding) {
        add('CK109', at('params', pi, 'padding'), `${p.name}: padding ${p.padding} is not allowed here`,
          'per_param: (-numel) mod partition_count; flat: 0 without parameter_alignment');
      }
      if (p.offset !== next) add('CK106', at('params', pi, 'offset'), `${p.name}: offset ${p.offset}, expected ${next}`,
        'params lie back to back');
      next = p.offset + (perParam ? Math.floor((p.numel + p.padding) / P) : p.numel + p.padding);
    });
    // CK107: the group's lengths.
    const end = lastEnd(g.params);
    const shares = g.params.reduce((s, p) => s + Math.floor((p.numel + p.padding) / P), 0);
    if (perParam && g.partition_numel !== shares) {
      add('CK107', at('partition_numel'), `partition_numel ${g.partition_numel}, the params' shares add up to ${shares}`,
        'see spec.md#groups');
    }
    if (!perParam && g.padded_numel !== roundUp(end, g.alignment)) {
      add('CK107', at('padded_numel'), `padded_numel ${g.padded_numel}, expected ${roundUp(end, g.alignment)}`, 'see spec.md#groups');
    }
    if (g.partition_numel * P !== g.padded_numel) add('CK107', at(), 'partition_numel x partition_count != padded_numel',
      'see spec.md#groups');
    // CK108: what each rank saved; flat groups may strip the tail padding from the last rank(s).
    if (g.saved_numels.length !== P) return;
    g.saved_numels.forEach((saved, r) => {
      const full = g.partition_numel;
      const want = perParam || m.layout.tail_padding_saved ? full : Math.min(full, Math.max(0, end - r * full));
      if (saved !== want) add('CK108', at('saved_numels', r), `rank ${r} saved ${saved} elements, expected ${want}`,
        'see spec.md#partition-arithmetic');
    });
  });
}

// Every kind of locator a file entry carries (1.0: partitions; 1.1: tensors, model_weights, state_partitions).
const LOCATOR_KEYS = ['partitions', 'tensors', 'model_weights', 'state_partitions'];

// spec.md#files, spec.md#locators
function fileRules(m, add) {
  const paths = new Set();
  const located = new Set();
  m.files.forEach((f, fi) => {
    // CK113, CK114: plain relative paths, each listed once.
    const parts = f.path.replace(/\\/g, '/').split('/');
    if (/^[/\\]|^[A-Za-z]:/.test(f.path) || f.path.includes('\0') || parts.some((s) => ['', '.', '..'].includes(s))) {
      add('CK113', ['files', fi, 'path'], `${JSON.stringify(f.path)} leaves the checkpoint directory`, 'use a plain relative path');
    }
    if (paths.has(f.path)) add('CK114', ['files', fi, 'path'], `${f.path} is listed twice`, 'list each file once');
    paths.add(f.path);
    // CK115: ranks in range; CK116: each partition located once; CK117: its length and dtype.
    f.ranks.forEach((r, j) => {
      if (r >= m.layout.world_size) add('CK115', ['files', fi, 'ranks', j], `rank ${r} is outside world_size ${m.layout.world_size}`,
        'ranks count from 0');
    });
    for (const key of ['partitions', 'state_partitions']) {
      (f[key] ?? []).forEach((loc, k) => {
        const g = m.groups[loc.group];
        const at = (...more) => ['files', fi, key, k, ...more];
        if (!g) add('CK115', at('group'), `group ${loc.group} does not exist`, 'group indexes $.groups');
        else if (loc.rank >= g.partition_count) add('CK115', at('rank'), `rank ${loc.rank} is outside the group's partitions`,
          'rank < partition_count');
        else if (!f.ranks.includes(loc.rank)) add('CK115', at('rank'), `rank ${loc.rank} is not a rank of ${f.path}`,
          'a file holds its own ranks');
      });
    }
    (f.model_weights ?? []).forEach((loc, k) => {
      if (!m.groups[loc.group]) add('CK115', ['files', fi, 'model_weights', k, 'group'], `group ${loc.group} does not exist`,
        'group indexes $.groups');
    });
    f.partitions.forEach((loc, k) => {
      const at = (...more) => ['files', fi, 'partitions', k, ...more];
      const g = m.groups[loc.group];
      if (g && loc.rank < g.partition_count) {
        const key = `${loc.group}/${loc.rank}`;
        if (located.has(key)) add('CK116', at(), `group ${loc.group} rank ${loc.rank} is located twice`, 'locate each partition once');
        located.add(key);
        if (loc.rank < g.saved_numels.length && loc.numel !== g.saved_numels[loc.rank]) {
          add('CK117', at('numel'), `locator holds ${loc.numel} elements, the rank saved ${g.saved_numels[loc.rank]}`,
            'numel is saved_numels[rank]');
        }
        if (loc.dtype !== m.layout.master_dtype) {
          add('CK117', at('dtype'), `locator dtype ${loc.dtype} is not master_dtype ${m.layout.master_dtype}`,
            'partitions hold master weights');
        }
      }
    });
    // CK118, CK119: every locator's bytes lie inside its member, and the member inside the file.
    for (const key of LOCATOR_KEYS) {
      (f[key] ?? []).forEach((loc, k) => {
        if ((loc.element_offset + loc.numel) * ITEMSIZE[loc.dtype] > loc.member_size) {
          add('CK118', ['files', fi, key, k], `elements end past the ${loc.member_size}-byte member`,
            'element_offset + numel must fit in the member');
        }
        if (loc.data_offset + loc.member_size > f.size) add('CK119', ['files', fi, key, k], `member ends past the ${f.size}-byte file`,
          'data_offset + member_size <= size');
      });
    }
  });
  // CK116: either no partition is located, or all of them are.
  if (!located.size) return;
  m.groups.forEach((g, gi) => {
    const missing = [...Array(g.partition_count).keys()].filter((r) => !located.has(`${gi}/${r}`));
    if (missing.length) add('CK116', ['groups', gi], `no locator for rank(s) ${missing.slice(0, 5).join(', ')}`,
      'locate every rank\'s partition');
  });
}

// The real elements of rank r's stage-3 fragment of an n-element tensor: ceil(n / ws), less at the end.
const fragmentNumel = (n, ws, r) => Math.max(0, Math.min(Math.ceil(n / ws), n - r * Math.ceil(n / ws)));
const fileRank = (f) => (f.ranks.length === 1 ? f.ranks[0] : null);
const HOLDERS = { tensors: 'model_states', model_weights: 'model_states', state_partitions: 'optimizer_states' };

// spec.md#tensor-locators, spec.md#model-weights (format 1.1)
function locatorRules(m, add) {
  const targets = new Map();
  for (const section of ['frozen', 'buffers']) m[section].forEach((t, i) => { if (!targets.has(t.name)) targets.set(t.name, [section, i, t]); });
  const roles = new Map([
    ...m.groups.flatMap((g) => g.params.map((p) => [p.name, 'a trainable parameter'])),
    ...m.aliases.map((a) => [a.name, 'an alias (located through its owner)']),
    ...m.excluded.map((e) => [e.name, 'excluded from the checkpoint']),
  ]);
  const named = [];
  m.files.forEach((f, fi) => (f.tensors ?? []).forEach((loc, k) => named.push([fi, k, f, loc])));
  // CK120: a named locator names a frozen param or buffer; each kind of locator sits in its kind of file.
  for (const [fi, k, , loc] of named) {
    if (!targets.has(loc.name)) {
      add('CK120', ['files', fi, 'tensors', k, 'name'], `locates ${loc.name}, which is ${roles.get(loc.name) ?? 'not declared'}`,
        'files[].tensors locate frozen parameters and buffers');
    }
  }
  m.files.forEach((f, fi) => {
    for (const [key, role] of Object.entries(HOLDERS)) {
      if ((f[key] ?? []).length && f.role !== role) add('CK120', ['files', fi, key], `a ${f.role} file carries ${key}`,
        `${key} belong to ${role} files`);
    }
  });
  // CK121: if any file locates named tensors, each frozen param and buffer is located as stored.
  if (m.files.some((f) => 'tensors' in f)) {
    const world = m.layout.world_size;
    const seen = new Map();
    for (const [, , f, loc] of named) seen.set(loc.name, [...(seen.get(loc.name) ?? []), fileRank(f)]);
    for (const [section, i, t] of targets.values()) {
      const ranks = seen.get(t.name) ?? [];
      if (section === 'frozen' && t.stored_in === 'partitioned_fragments') {
        const wrong = ranks.some((r) => r === null || r >= world || ranks.filter((x) => x === r).length > 1);
        const missing = [...Array(world).keys()].filter((r) => !ranks.includes(r));
        if (wrong || missing.length) add('CK121', [section, i], `${t.name}: fragments missing or repeated`,
          'locate rank r\'s fragment once, in rank r\'s model-states file');
      } else if (ranks.length !== 1) {
        add('CK121', [section, i], `${t.name} is located ${ranks.length} times`, 'locate each frozen parameter and buffer once');
      }
    }
  }
  // CK122: a named locator holds the tensor's real elements in its dtype.
  for (const [fi, k, f, loc] of named) {
    if (!targets.has(loc.name)) continue;
    const [section, , t] = targets.get(loc.name);
    let numel = section === 'frozen' ? t.numel : Number(product(t.shape));
    if (section === 'frozen' && t.stored_in === 'partitioned_fragments') {
      const r = fileRank(f);
      if (r === null || r >= m.layout.world_size) continue;
      numel = fragmentNumel(numel, m.layout.world_size, r);
    }
    if (loc.numel !== numel) add('CK122', ['files', fi, 'tensors', k, 'numel'], `${loc.name}: ${loc.numel} elements, the tensor has ${numel} here`,
      'numel counts the real elements');
    if (loc.dtype !== t.dtype) add('CK122', ['files', fi, 'tensors', k, 'dtype'], `${loc.name}: dtype ${loc.dtype}, the tensor's ${t.dtype}`,
      'a locator has the dtype of the tensor it locates');
  }
  // CK123: each flat group's low-precision weights: once, padded_numel elements of model_dtype.
  const weights = new Set();
  m.files.forEach((f, fi) => (f.model_weights ?? []).forEach((loc, k) => {
    const g = m.groups[loc.group];
    const at = (...more) => ['files', fi, 'model_weights', k, ...more];
    if (!g) return;
    if (g.partitioning !== 'flat') { add('CK123', at('group'), `group ${loc.group} is per_param`, 'flat groups only'); return; }
    if (weights.has(loc.group)) add('CK123', at(), `group ${loc.group} is located twice`, 'locate each group once');
    weights.add(loc.group);
    if (loc.numel !== g.padded_numel) add('CK123', at('numel'), `${loc.numel} elements, the group ${g.padded_numel}`, 'numel is padded_numel');
    if (loc.dtype !== m.layout.model_dtype) add('CK123', at('dtype'), `dtype ${loc.dtype}, model_dtype ${m.layout.model_dtype}`,
      'the flat weights hold the model dtype');
  }));
}

// spec.md#state-partitions, spec.md#optimizer (format 1.1)
function optimizerRules(m, add) {
  // CK124: each (group, rank, state) located once; every rank of a group holds the same states.
  const seen = new Set();
  const states = new Map();
  m.files.forEach((f, fi) => (f.state_partitions ?? []).forEach((loc, k) => {
    const g = m.groups[loc.group];
    if (!g || loc.rank >= g.partition_count) return;
    const key = `${loc.group}/${loc.rank}/${loc.state}`;
    if (seen.has(key)) add('CK124', ['files', fi, 'state_partitions', k], `${loc.state} of group ${loc.group} rank ${loc.rank} is located twice`,
      'locate each state partition once');
    seen.add(key);
    states.set(loc.group, new Set([...(states.get(loc.group) ?? []), loc.state]));
    // CK125: a state partition keeps the whole partition, padding included.
    if (loc.numel !== g.partition_numel) add('CK125', ['files', fi, 'state_partitions', k, 'numel'],
      `${loc.numel} elements, the group's partitions ${g.partition_numel}`, 'a state partition is partition_numel long on every rank');
  }));
  for (const [g, names] of [...states.entries()].sort((a, b) => a[0] - b[0])) {
    for (let r = 0; r < m.groups[g].partition_count; r++) {
      if ([...names].some((s) => !seen.has(`${g}/${r}/${s}`))) add('CK124', ['groups', g], `rank ${r} lacks a state of group ${g}`,
        'every rank holds every state of the group');
    }
  }
  // CK126: optimizer.groups describes each optimizer param group of $.groups once.
  if (!m.optimizer) return;
  const declared = new Set(m.groups.map((g) => g.optimizer_group));
  const described = new Set();
  m.optimizer.groups.forEach((entry, k) => {
    const at = ['optimizer', 'groups', k, 'optimizer_group'];
    if (described.has(entry.optimizer_group)) add('CK126', at, `optimizer group ${entry.optimizer_group} is described twice`, 'describe each once');
    else if (!declared.has(entry.optimizer_group)) add('CK126', at, `optimizer group ${entry.optimizer_group} holds no group`,
      'describe the optimizer groups $.groups names');
    described.add(entry.optimizer_group);
  });
  if ([...declared].some((g) => !described.has(g))) add('CK126', ['optimizer', 'groups'], 'an optimizer group is not described',
    'describe every optimizer group $.groups names');
}

function semanticFindings(m) {
  const out = [];
  const add = (code, parts, message, hint) => out.push(finding(code, jsonPath(parts), message, hint));
  for (const rules of [tensorRules, groupRules, fileRules, locatorRules, optimizerRules]) rules(m, add);
  return out;
}

// The whole check of a decoded manifest; `validators`: compileSchemas() (or one compiled schema).
function checkManifest(validators, doc) {
  const gate = versionGate(doc);
  if (gate.stop) return gate.findings;
  const validate = schemaFor(validators, doc);
  const found = [...gate.findings, ...unsafeIntegers(doc), ...schemaFindings(validate, doc, gate.newerMinor)];
  if (found.some((f) => f.severity === 'error')) return found;
  return [...found, ...semanticFindings(doc)];
}

module.exports = {
  SCHEMA_DIR, SCHEMA_FILE, SCHEMA_FILES, SEMVER, finding, compileSchema, compileSchemas, byVersion, schemaFor,
  versionGate, unsafeIntegers, schemaFindings, semanticFindings, checkManifest, jsonPath, fragmentNumel,
};
