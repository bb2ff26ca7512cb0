'use strict';
// What a reader checks before it uses any field of a manifest (docs/spec.md#conformance), in order:
//   1. the format-version gate (spec.md#versioning): another major stops everything (CK003);
//   2. the JSON Schema, with ajv (draft 2020-12); a newer minor may carry unknown keys (CK004);
//   3. the semantic rules CK101-CK119 (docs/errors.md), which the schema cannot express.
// Each finding is {code, where, message, hint, severity}; the codes are ckptspec's.
const fs = require('fs');
const path = require('path');
const Ajv2020 = require('ajv/dist/2020');
const { ITEMSIZE } = require('./dtypes');

const SCHEMA_FILE = path.join(__dirname, '..', '..', 'schema', 'manifest-1.0.schema.json');
const READER = { major: 1, minor: 0 };
const SEMVER = /^(0|[1-9][0-9]{0,5})\.(0|[1-9][0-9]{0,5})\.(0|[1-9][0-9]{0,5})$/;

const finding = (code, where, message, hint, severity = 'error') => ({ code, where, message, hint, severity });

// ["groups", 0, "numel"] -> "$.groups[0].numel" (the paths ckptspec prints).
function jsonPath(parts) {
  return '$' + parts.map((p) => (typeof p === 'number' ? `[${p}]`
    : /^[A-Za-z_][A-Za-z0-9_]*$/.test(p) ? `.${p}` : `[${JSON.stringify(p)}]`)).join('');
}

// strict: any keyword ajv does not know, or an ambiguous type, is an error; warnings are collected.
function compileSchema(file = SCHEMA_FILE, warnings = []) {
  const note = (...args) => warnings.push(args.join(' '));
  const ajv = new Ajv2020({ strict: true, allErrors: true, logger: { log: note, warn: note, error: note } });
  return ajv.compile(JSON.parse(fs.readFileSync(file, 'utf8')));
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
    f.partitions.forEach((loc, k) => {
      const at = (...more) => ['files', fi, 'partitions', k, ...more];
      const g = m.groups[loc.group];
      if (!g) add('CK115', at('group'), `group ${loc.group} does not exist`, 'group indexes $.groups');
      else if (loc.rank >= g.partition_count) add('CK115', at('rank'), `rank ${loc.rank} is outside the group's partitions`,
        'rank < partition_count');
      else if (!f.ranks.includes(loc.rank)) add('CK115', at('rank'), `rank ${loc.rank} is not a rank of ${f.path}`,
        'a file holds its own ranks');
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
      // CK118, CK119: the bytes lie inside the member, and the member inside the file.
      if ((loc.element_offset + loc.numel) * ITEMSIZE[loc.dtype] > loc.member_size) {
        add('CK118', at(), `elements end past the ${loc.member_size}-byte member`, 'element_offset + numel must fit in the member');
      }
      if (loc.data_offset + loc.member_size > f.size) add('CK119', at(), `member ends past the ${f.size}-byte file`,
        'data_offset + member_size <= size');
    });
  });
  // CK116: either no partition is located, or all of them are.
  if (!located.size) return;
  m.groups.forEach((g, gi) => {
    const missing = [...Array(g.partition_count).keys()].filter((r) => !located.has(`${gi}/${r}`));
    if (missing.length) add('CK116', ['groups', gi], `no locator for rank(s) ${missing.slice(0, 5).join(', ')}`,
      'locate every rank\'s partition');
  });
}

function semanticFindings(m) {
  const out = [];
  const add = (code, parts, message, hint) => out.push(finding(code, jsonPath(parts), message, hint));
  for (const rules of [tensorRules, groupRules, fileRules]) rules(m, add);
  return out;
}

// The whole check of a decoded manifest; `validate` is a compiled schema.
function checkManifest(validate, doc) {
  const gate = versionGate(doc);
  if (gate.stop) return gate.findings;
  const found = [...gate.findings, ...unsafeIntegers(doc), ...schemaFindings(validate, doc, gate.newerMinor)];
  if (found.some((f) => f.severity === 'error')) return found;
  return [...found, ...semanticFindings(doc)];
}

module.exports = { SCHEMA_FILE, compileSchema, versionGate, unsafeIntegers, schemaFindings, semanticFindings, checkManifest, jsonPath };
