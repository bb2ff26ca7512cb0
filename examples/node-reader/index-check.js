'use strict';
// What a reader checks before it uses any field of a checkpoint index (docs/spec-checkpoint.md,
// format `ckptspec.checkpoint` 1.0 and 1.1), in ckptspec's order (format/index_validate.py):
//   1. the format-version gate: another major stops everything (CK003), a newer minor is a warning (CK004);
//   2. the JSON Schema of the index's own version (schema/checkpoint-1.x.schema.json, ajv: a 1.0 index may not
//      carry 1.1's fields; a newer minor against the latest); its `domains[].manifest` are objects there;
//   3. every domain's manifest, a complete 1.x document: check.js's whole check, its findings under
//      `$.domains[i].manifest` (a domain refused by its schema or version stops here, as in ckptspec);
//   4. the index rules CK602-CK610 (docs/errors.md), which the schema cannot express.
const fs = require('fs');
const path = require('path');
const Ajv2020 = require('ajv/dist/2020');
const { SCHEMA_DIR, SEMVER, byVersion, finding, jsonPath, unsafeIntegers, schemaFindings, checkManifest } = require('./check');
const { ITEMSIZE } = require('./dtypes');

const INDEX_SCHEMA_FILES = {
  '1.0': path.join(SCHEMA_DIR, 'checkpoint-1.0.schema.json'),
  '1.1': path.join(SCHEMA_DIR, 'checkpoint-1.1.schema.json'),
};
const INDEX_SCHEMA_FILE = INDEX_SCHEMA_FILES['1.1'];
const INDEX = { format: 'ckptspec.checkpoint', major: 1, minor: 1 };

// A document is an index by its `format` (a manifest says "ckptspec.manifest"): the one dispatch.
const isIndex = (doc) => doc !== null && typeof doc === 'object' && doc.format === INDEX.format;

function compileOne(file, warnings) {
  const note = (...args) => warnings.push(args.join(' '));
  const ajv = new Ajv2020({ strict: true, allErrors: true, logger: { log: note, warn: note, error: note } });
  return ajv.compile(JSON.parse(fs.readFileSync(file, 'utf8')));
}

// One validator function (its `errors` as ajv's): FILE's schema, or each document's own version's.
function compileIndexSchema(file = null, warnings = [], lazy = false) {
  if (file) return compileOne(file, warnings);
  const byLine = byVersion(INDEX_SCHEMA_FILES, (f) => compileOne(f, warnings), lazy);
  const validate = (doc) => {
    const version = doc !== null && typeof doc === 'object' ? doc.format_version : undefined;
    const line = typeof version === 'string' && SEMVER.test(version) ? version.split('.').slice(0, 2).join('.') : null;
    const chosen = byLine[line] ?? byLine[`${INDEX.major}.${INDEX.minor}`];
    const ok = chosen(doc);
    validate.errors = chosen.errors;
    return ok;
  };
  return validate;
}

function indexVersionGate(doc) {
  const version = doc.format_version;
  if (typeof version !== 'string' || !SEMVER.test(version)) return { findings: [], stop: false, newerMinor: false };
  const [major, minor] = version.split('.').map(Number);
  if (major !== INDEX.major) {
    return { stop: true, newerMinor: false, findings: [finding('CK003', '$.format_version',
      `checkpoint index version ${version} has major ${major}; this reader understands ${INDEX.major}`,
      'use a reader for that major version')] };
  }
  if (minor > INDEX.minor) {
    return { stop: false, newerMinor: true, findings: [finding('CK004', '$.format_version',
      `checkpoint index version ${version} is newer than ${INDEX.major}.${INDEX.minor}; unknown fields are ignored`,
      'a newer reader checks every field', 'warning')] };
  }
  return { findings: [], stop: false, newerMinor: false };
}

// ---- the index rules (format/index_rules.py); they assume a schema-valid index with valid domain manifests

const prod = (shape) => shape.reduce((a, d) => a * d, 1);
const same = (a, b) => JSON.stringify(a) === JSON.stringify(b);
const localParams = (m) => new Map(m.groups.flatMap((g) => g.params.map((p) => [p.name, p.shape])));
const placementKind = (p) => (typeof p === 'string' ? p : Object.keys(p)[0]);
const SPLIT_HINT = 'split shards are blocks along one axis that tile it without gap or overlap';
const LAYER_HINT = 'each pipeline layer has one layer file, written by the stage that owns the layer';

// CK602: the degrees agree with each other, the rank grid and every domain's coordinate.
function topology(doc, add) {
  const topo = doc.topology;
  const deg = topo.degrees;
  if (deg.pipeline * deg.tensor !== topo.model_parallel_size) {
    add('CK602', ['topology', 'model_parallel_size'], `model_parallel_size ${topo.model_parallel_size} is not pipeline `
      + `${deg.pipeline} x tensor ${deg.tensor}`, 'DeepSpeed\'s mp_world_size is the product of the pipeline and tensor degrees');
  }
  const grid = ['pipeline', 'tensor', 'data'];
  if (topo.ranks) {
    const world = prod(grid.map((a) => deg[a]));
    const seen = new Set(topo.ranks.map((r) => grid.map((a) => r[a]).join('/')));
    if (topo.ranks.length !== world || seen.size !== world || new Set(topo.ranks.map((r) => r.rank)).size !== world) {
      add('CK602', ['topology', 'ranks'], `${topo.ranks.length} ranks with ${seen.size} distinct coordinates; the degrees give ${world}`,
        'list every rank of the launch once, with its own (pipeline, tensor, data) coordinate');
    }
    topo.ranks.forEach((r, i) => grid.forEach((axis) => {
      if (r[axis] >= deg[axis]) add('CK602', ['topology', 'ranks', i, axis], `${axis} coordinate ${r[axis]} is outside degree ${deg[axis]}`,
        'coordinates count from 0 below their degree');
    }));
  }
  const dense = new Map();
  doc.domains.forEach((dom, i) => {
    for (const [axis, value] of Object.entries(dom.coordinate)) {
      if (axis in deg && value >= deg[axis]) add('CK602', ['domains', i, 'coordinate', axis],
        `${axis} coordinate ${value} is outside degree ${deg[axis]}`, 'coordinates count from 0 below their degree');
    }
    if (dom.process_group !== 'data_parallel') return;
    const key = `${dom.coordinate.pipeline ?? 0}/${dom.coordinate.tensor ?? 0}`;
    if (dense.has(key)) {
      const [p, t] = key.split('/');
      add('CK602', ['domains', i, 'coordinate'], `a second data-parallel domain at pipeline ${p}, tensor ${t} `
        + `(the first is domains[${dense.get(key)}])`, 'each (pipeline, tensor) coordinate has one data-parallel domain');
    } else dense.set(key, i);
  });
  for (let p = 0; p < deg.pipeline; p++) {
    for (let t = 0; t < deg.tensor; t++) {
      if (!dense.has(`${p}/${t}`) && doc.kind !== 'universal') add('CK602', ['domains'], `no data-parallel domain for pipeline ${p}, tensor ${t}`,
        'every model-parallel rank of the topology has its domain (its files)');
    }
  }
}

// CK603: a domain's size is its manifest's world size; its files' domain ranks are the manifest's ranks.
function domainSize(doc, add) {
  const ids = new Map();
  doc.domains.forEach((dom, i) => {
    if (ids.has(dom.id)) add('CK603', ['domains', i, 'id'], `domain id ${JSON.stringify(dom.id)} is also domains[${ids.get(dom.id)}]'s`,
      'domain ids are unique: shards name their domain by id');
    else ids.set(dom.id, i);
    const worldSize = dom.manifest.layout.world_size;
    if (dom.size !== worldSize) add('CK603', ['domains', i, 'size'], `size ${dom.size} but the domain's manifest has world_size ${worldSize}`,
      'a domain\'s manifest describes the partitions over the domain\'s own process group');
    if (dom.members && dom.members.length !== dom.size) add('CK603', ['domains', i, 'members'],
      `${dom.members.length} members for a domain of size ${dom.size}`, 'members lists the global rank of each domain rank');
    const files = new Map(dom.manifest.files.filter((f) => ['model_states', 'optimizer_states'].includes(f.role)).map((f) => [f.path, f]));
    for (const [file, rank] of Object.entries(dom.file_ranks)) {
      const entry = files.get(file);
      if (rank >= dom.size || !entry || !entry.ranks.includes(rank)) add('CK603', ['domains', i, 'file_ranks', file],
        `file_ranks gives ${file} domain rank ${rank}; the domain's manifest ${entry ? `gives ranks [${entry.ranks}]` : 'does not list it'}`,
        'file_ranks and the manifest\'s files[].ranks say the same thing');
    }
    for (const file of files.keys()) {
      if (!(file in dom.file_ranks)) add('CK603', ['domains', i, 'file_ranks'], `${file} is in the domain's manifest but not in file_ranks`,
        'every model- and optimizer-states file of a domain has its domain rank in file_ranks');
    }
  });
}

// CK604: a file listed by several domains is listed with the same size and hash by each.
function sharedFiles(doc, add) {
  const first = new Map();
  doc.domains.forEach((dom, i) => dom.manifest.files.forEach((f, j) => {
    if (!first.has(f.path)) { first.set(f.path, [i, f]); return; }
    const [k, other] = first.get(f.path);
    if (f.size !== other.size || !same(f.hash ?? null, other.hash ?? null)) add('CK604', ['domains', i, 'manifest', 'files', j],
      `${f.path} is listed by domains[${k}] too, with another size or hash`, 'one file has one size and one hash');
  }));
}

function tiles(blocks, length) {
  let pos = 0;
  for (const [offset, size] of [...blocks].sort((a, b) => a[0] - b[0] || a[1] - b[1])) {
    if (offset !== pos) return false;
    pos += size;
  }
  return pos === length;
}

// CK605: every whole-model parameter's shards compose its shape exactly.
function shardsCompose(doc, add) {
  const whole = [...doc.parameters.map((p, i) => ['parameters', i, p]), ...(doc.extras ?? []).map((e, i) => ['extras', i, e])];
  whole.forEach(([key, i, param]) => {
    const { shape, shards, name } = param;
    const at = [key, i, 'shards'];
    const kinds = [...new Set(shards.map((s) => placementKind(s.placement)))].sort();
    if (kinds.length !== 1) { add('CK605', at, `${name}: shards mix placements [${kinds}]`, 'one placement per parameter'); return; }
    const kind = kinds[0];
    if (kind === 'replicated' || kind === 'whole') {
      const bad = shards.findIndex((s) => !same(s.local_shape, shape));
      const primaries = shards.filter((s) => s.primary ?? shards.length === 1).length;
      if (bad >= 0) add('CK605', [key, i, 'shards', bad, 'local_shape'],
        `${name}: a ${kind} shard of shape [${shards[bad].local_shape}], not [${shape}]`, `a ${kind} shard is the whole tensor`);
      if (primaries !== 1 || (kind === 'whole' && shards.length !== 1)) add('CK605', at,
        `${name}: ${shards.length} ${kind} shards, ${primaries} primary`, 'a whole parameter has one shard; replicated ones have exactly one primary');
    } else if (kind === 'split') {
      const axes = [...new Set(shards.map((s) => s.placement.split.axis))];
      const axis = axes.length === 1 ? axes[0] : null;
      if (axis === null || axis >= shape.length) { add('CK605', at, `${name}: split along axes [${axes}]`, SPLIT_HINT); return; }
      const blocks = shards.map((s) => [s.placement.split.offset, s.placement.split.length]);
      const wrong = shards.some((s) => !same(s.local_shape, [...shape.slice(0, axis), s.placement.split.length, ...shape.slice(axis + 1)]));
      if (wrong || !tiles(blocks, shape[axis])) add('CK605', at, `${name}: the shards do not tile shape [${shape}] along axis ${axis}`, SPLIT_HINT);
    } else {
      const total = shards.reduce((n, s) => n + s.placement.pieces.reduce((m, p) => m + prod(p.shape), 0), 0);
      if (total !== prod(shape)) add('CK605', at, `${name}: pieces hold ${total} elements, the shape [${shape}] ${prod(shape)}`,
        'affine pieces cover every element of the whole tensor once');
    }
  });
}

// CK606: each trainable parameter of each domain is a shard of exactly one whole-model parameter.
function shardsClaimed(doc, add) {
  const domains = new Map(doc.domains.map((d, i) => [d.id, [i, localParams(d.manifest)]]));
  const claimed = new Map();
  doc.parameters.forEach((param, i) => param.shards.forEach((shard, j) => {
    const at = ['parameters', i, 'shards', j];
    if (!domains.has(shard.domain)) { add('CK606', at, `no domain ${JSON.stringify(shard.domain)}`, 'a shard names a domain of the index'); return; }
    const local = domains.get(shard.domain)[1];
    const key = JSON.stringify([shard.domain, shard.local_name]);
    if (!local.has(shard.local_name) || !same(local.get(shard.local_name), shard.local_shape)) {
      const what = local.has(shard.local_name) ? `has shape [${local.get(shard.local_name)}] for` : 'has no parameter';
      add('CK606', at, `domain ${JSON.stringify(shard.domain)} ${what} ${JSON.stringify(shard.local_name)} (shard of ${param.name}, `
        + `local shape [${shard.local_shape}])`, 'a shard is a trainable parameter of its domain\'s manifest, with the same shape');
    } else if (claimed.has(key)) {
      add('CK606', at, `${JSON.stringify(shard.local_name)} of domain ${JSON.stringify(shard.domain)} is also a shard of `
        + `parameters[${claimed.get(key)}]`, 'each local parameter is a shard of one whole-model parameter');
    }
    if (!claimed.has(key)) claimed.set(key, i);
  }));
  for (const [id, [i, local]] of domains) {
    for (const name of local.keys()) {
      if (!claimed.has(JSON.stringify([id, name]))) add('CK606', ['domains', i, 'manifest', 'groups'],
        `${JSON.stringify(name)} of domain ${JSON.stringify(id)} is no shard of any whole-model parameter`,
        'list it as a shard in parameters[], or the merged model would lose it');
    }
  }
}

// CK607: pipeline layer files: one per layer, at a stage of the topology, naming that stage's shards.
function layerFiles(doc, add) {
  const stageOf = new Map(doc.domains.map((d) => [d.id, d.coordinate.pipeline ?? 0]));
  const keys = new Map(doc.parameters.flatMap((p) => p.shards.filter((s) => 'layer_file' in s)
    .map((s) => [JSON.stringify([s.layer_file, s.layer_key ?? null]), stageOf.get(s.domain)])));
  const seen = new Map();
  doc.layer_files.forEach((lf, i) => {
    const key = JSON.stringify([lf.layer, lf.tensor ?? null]);
    if (lf.pipeline >= doc.topology.degrees.pipeline) add('CK607', ['layer_files', i],
      `${lf.path}: stage ${lf.pipeline} of ${doc.topology.degrees.pipeline}`, LAYER_HINT);
    if (seen.has(key)) add('CK607', ['layer_files', i], `${lf.path}: layer ${lf.layer} is also layer_files[${seen.get(key)}]`, LAYER_HINT);
    else seen.set(key, i);
    for (const localKey of Object.keys(lf.tensors)) {
      const stage = keys.get(JSON.stringify([lf.path, localKey]));
      if (stage !== undefined && stage !== lf.pipeline) add('CK607', ['layer_files', i, 'tensors', localKey],
        `${lf.path} (stage ${lf.pipeline}) holds ${JSON.stringify(localKey)}, a shard of another stage's domain`, LAYER_HINT);
    }
  });
  const listed = new Set(doc.layer_files.map((lf) => lf.path));
  const named = [...new Set([...keys.keys()].map((k) => JSON.parse(k)[0]))].filter((p) => !listed.has(p)).sort();
  for (const file of named) add('CK607', ['parameters'], `a shard names layer file ${file}, which layer_files does not list`,
    `${LAYER_HINT}; restore the file if it is missing`);
}

// CK608: where a merge rule came from is recorded, and it fits the placements.
function placementSource(doc, add) {
  const tensorPipeline = doc.layer_files.some((lf) => lf.tensor !== undefined && lf.tensor !== null);
  doc.parameters.forEach((param, i) => {
    const source = param.placement_source;
    const split = param.shards.some((s) => typeof s.placement !== 'string');
    if (split && !['affine_map', 'universal_checkpoint_info', 'engine'].includes(source)) {
      add('CK608', ['parameters', i, 'placement_source'], `${param.name}: split shards with placement_source ${JSON.stringify(source)}`,
        'a tensor-parallel split is known from DeepSpeed\'s affine_map, universal_checkpoint_info or the live engine; '
        + 'an unknown rule is refused, never guessed');
    }
    const layered = param.shards.some((s) => 'layer_file' in s);
    // a tensor-parallel pipeline's layer files hold shards whose merge rule is the recorded one, replicated too
    const ruled = layered && tensorPipeline && ['affine_map', 'universal_checkpoint_info'].includes(source);
    if (layered !== (source === 'pipeline_layer') && !split && !ruled) {
      add('CK608', ['parameters', i, 'placement_source'], `${param.name}: placement_source ${JSON.stringify(source)} `
        + `${layered ? 'with' : 'without'} a layer file`, 'pipeline_layer is the source exactly when the shard lives in a pipeline layer file');
    }
  });
}

// CK609: what a domain's `masters` and `replicas` locate is in its manifest's master_dtype.
function masterDtype(doc, add) {
  doc.domains.forEach((dom, i) => {
    const want = dom.manifest.layout.master_dtype;
    const located = [...(dom.masters?.tensors ?? []).map((loc, j) => [['masters', 'tensors', j], loc]),
      ...(dom.replicas ?? []).map((loc, j) => [['replicas', j], loc])];
    const wrong = located.filter(([, loc]) => loc.dtype !== want);
    if (!wrong.length) return;
    const [at, loc] = wrong[0];
    const more = wrong.length > 1 ? ` (${wrong.length - 1} more locators of this domain too)` : '';
    add('CK609', ['domains', i, ...at], `the master of ${JSON.stringify(loc.param)} is located in ${loc.dtype} data (${loc.file}: `
      + `${loc.key.join('/')}); the domain's master_dtype is ${want}${more}`,
    'these are not the fp32 masters: regenerate the index with `ckptspec generate CHECKPOINT`');
  });
}

// CK610 (1.1): each extra's shards are tensors their domains hold (the domain manifest's frozen parameter or
// buffer, or a layer file's key of the domain's stage, located inside its member); names and ties are of one
// whole model; with `extras` there, every frozen parameter and buffer of a ZeRO domain is a shard of one.
function extrasPlaced(doc, add) {
  const HINT = 'regenerate the checkpoint index with `ckptspec generate CHECKPOINT`';
  const domains = new Map(doc.domains.map((d) => [d.id, d]));
  const layerFiles = new Map(doc.layer_files.map((lf) => [lf.path, lf]));
  const held = (m) => new Map([...m.frozen.map((f) => [`frozen:${f.name}`, f]), ...m.buffers.map((b) => [`buffer:${b.name}`, b])]);
  const names = new Set(doc.parameters.map((p) => p.name));
  const claimed = new Set();
  const problem = (extra, shard, dom) => {
    if (!dom) return `no domain ${JSON.stringify(shard.domain)}`;
    const loc = shard.locator;
    if (!loc) {
      const h = held(dom.manifest).get(`${extra.role}:${shard.local_name}`);
      if (!h) return `domain ${JSON.stringify(shard.domain)} has no ${extra.role} ${JSON.stringify(shard.local_name)}`;
      if (!same(h.shape, shard.local_shape) || h.dtype !== extra.dtype) return `domain ${JSON.stringify(shard.domain)}'s shard differs`;
      return null;
    }
    const lf = layerFiles.get(shard.layer_file ?? '');
    if (!lf || lf.pipeline !== dom.coordinate.pipeline) return `a locator in ${JSON.stringify(shard.layer_file)}, no layer file of the domain's stage`;
    if (lf.tensors[shard.layer_key ?? ''] !== shard.local_name) return `${lf.path} has no key ${JSON.stringify(shard.layer_key)}`;
    if (loc.dtype !== extra.dtype || loc.numel !== prod(shard.local_shape)) return `the locator holds ${loc.numel} ${loc.dtype} elements`;
    if ((loc.element_offset + loc.numel) * ITEMSIZE[loc.dtype] > loc.member_size) return `the locator's elements end past member ${loc.member}`;
    return null;
  };
  (doc.extras ?? []).forEach((extra, i) => {
    if (names.has(extra.name)) add('CK610', ['extras', i, 'name'], `${JSON.stringify(extra.name)} names two tensors`, HINT);
    names.add(extra.name);
    extra.shards.forEach((shard, j) => {
      const why = problem(extra, shard, domains.get(shard.domain));
      if (why) add('CK610', ['extras', i, 'shards', j], `${extra.name}: ${why}`, HINT);
      claimed.add(JSON.stringify([shard.domain, extra.role, shard.local_name]));
    });
  });
  for (const [alias, owner] of Object.entries(doc.aliases ?? {})) {
    if (names.has(alias) || !names.has(owner)) add('CK610', ['aliases', alias], `tie ${JSON.stringify(alias)} -> ${JSON.stringify(owner)}`,
      'a tie names a whole-model parameter, frozen parameter or buffer as its owner, and is none itself');
  }
  if (!doc.extras) return;
  doc.domains.forEach((dom, i) => {
    if (dom.masters) return;
    for (const [key] of held(dom.manifest)) {
      const [role, name] = [key.slice(0, key.indexOf(':')), key.slice(key.indexOf(':') + 1)];
      if (!claimed.has(JSON.stringify([dom.id, role, name]))) add('CK610', ['domains', i, 'manifest', role === 'frozen' ? 'frozen' : 'buffers'],
        `${role} ${JSON.stringify(name)} of domain ${JSON.stringify(dom.id)} is no shard of any extra`,
        'list it as a shard in extras[], or the merged model would lose it');
    }
  });
}

const INDEX_RULES = [topology, domainSize, sharedFiles, shardsCompose, shardsClaimed, layerFiles, placementSource, masterDtype,
  extrasPlaced];

// The whole check of a decoded index: `validate` its compiled schema, `manifestValidators` check.js's compileSchemas().
function checkIndex(validate, manifestValidators, doc) {
  const gate = indexVersionGate(doc);
  if (gate.stop) return gate.findings;
  const found = [...gate.findings, ...unsafeIntegers(doc), ...schemaFindings(validate, doc, gate.newerMinor)];
  if (found.some((f) => f.severity === 'error')) return found;
  let refused = false;
  doc.domains.forEach((dom, i) => {
    for (const f of checkManifest(manifestValidators, dom.manifest)) {
      found.push({ ...f, where: `${jsonPath(['domains', i, 'manifest'])}${f.where.slice(1)}` });
      refused ||= ['CK001', 'CK002', 'CK003'].includes(f.code);
    }
  });
  if (refused) return found;
  const add = (code, parts, message, hint) => found.push(finding(code, jsonPath(parts), message, hint));
  for (const rule of INDEX_RULES) rule(doc, add);
  return found;
}

module.exports = { INDEX_SCHEMA_FILE, INDEX_SCHEMA_FILES, isIndex, compileIndexSchema, checkIndex };
