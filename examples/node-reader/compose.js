'use strict';
// The whole model of a checkpoint index (docs/spec-checkpoint.md), from its locators alone: each
// domain's local tensors are located as a 1.x manifest's are (plan.js), or, for the kinds whose
// index locates the fp32 masters apart (ZeRO stage 0, MoE, the stage-0 pipeline, universal folders:
// `domains[].masters`), by those locators; then every whole-model parameter is composed from its
// shards as `parameters[].shards[].placement` says (export/compose_plan.py in ckptspec):
//   "whole"      the one shard is the parameter (a pipeline stage's, an expert's);
//   "replicated" every shard is the whole parameter: the primary is written, the others must equal it (CK401);
//   split        a block along one axis: each shard's rows of prod(shape[axis:]) elements interleave;
//   pieces       DeepSpeed's affine pieces: element (offsets, strides) of the whole <- of the shard.
// A 1.1 index places the frozen parameters and buffers of the whole model the same way (`extras`: each
// shard its domain manifest's frozen parameter or buffer, or a layer file's bytes through its `locator`)
// and names its ties (`aliases`). What the index does not locate (a masters domain's buffers, and in a 1.0
// index the frozen parameters and buffers of tensor-parallel domains and pipeline layer files: ckptspec
// reads them from the pickles) is named in the output's `ckptspec.absent` metadata, never guessed.
const { Refusal, openFiles, checkMember, readAt } = require('./files');
const { ITEMSIZE, OUTPUT_DTYPE, toFloat32 } = require('./dtypes');
const { refuseUnreadable, planManifest, addAliases, readRaw, readTensor, product } = require('./plan');
const { writeStateDict } = require('./safetensors');

const at = (i) => `$.domains[${i}].manifest`;
const MODEL_STATES = /^(?:zero_pp_rank_\d+_)?mp_rank_\d+_model_states\.pt$/; // deepspeed/layout/names.py MODEL_RE
const REGENERATE = 'run `ckptspec validate` and regenerate the checkpoint index';

// Every file the index lists, once: the domains' files (a file two domains share: CK604 made its
// entries equal), the pipeline layer files and the MoE expert files (each refused by its own code).
function indexFiles(index) {
  const entries = new Map();
  for (const dom of index.domains) for (const f of dom.manifest.files) if (!entries.has(f.path)) entries.set(f.path, f);
  index.layer_files.forEach((lf, i) => entries.set(lf.path, { ...lf, damage: 'layer', at: `$.layer_files[${i}]` }));
  (index.expert_files ?? []).forEach((ef, i) => entries.set(ef.path, { ...ef, damage: 'expert', at: `$.expert_files[${i}]` }));
  return [...entries.values()];
}

// A locator of `masters` or `replicas` -> a piece of plan.js's shape ({part: {fd, loc}, start, count}).
function masterPiece(loc, fds, where) {
  const fd = fds.get(loc.file);
  if (fd === undefined) throw new Refusal('CK401', where, `locates ${loc.param} in ${loc.file}, which the index does not list`, REGENERATE);
  checkMember(fd, loc.file, loc);
  return { part: { fd, loc }, start: 0, count: loc.numel };
}

// local name -> tensor, for a domain whose index locates its masters: a parameter's locators, in
// order, concatenated, are its flat master (spec-checkpoint.md#masters).
function masterTensors(dom, i, fds) {
  const params = new Map(dom.manifest.groups.flatMap((g) => g.params.map((p) => [p.name, p])));
  const out = new Map();
  dom.masters.tensors.forEach((loc, j) => {
    const p = params.get(loc.param);
    if (!p) throw new Refusal('CK401', `$.domains[${i}].masters.tensors[${j}]`, `locates ${loc.param}, no parameter of the domain`, REGENERATE);
    if (!out.has(p.name)) out.set(p.name, { name: p.name, shape: p.shape, dtype: loc.dtype, numel: p.numel, pieces: [] });
    const t = out.get(p.name);
    if (loc.dtype !== t.dtype) throw new Refusal('CK401', p.name, `located in ${t.dtype} and ${loc.dtype} data`, REGENERATE);
    if (loc.numel) t.pieces.push(masterPiece(loc, fds, `$.domains[${i}].masters.tensors[${j}]`));
  });
  for (const p of params.values()) {
    const got = out.get(p.name)?.pieces.reduce((n, x) => n + x.count, 0) ?? 0;
    if (got !== p.numel) {
      throw new Refusal('CK401', p.name, `the masters of domain ${dom.id} locate ${got} of its ${p.numel} elements`, REGENERATE);
    }
  }
  return out;
}

// spec-checkpoint.md#masters: each copy DeepSpeed saved of a master (`replicas`: a parameter's
// locators in one file, in order) equals it bit for bit (CK243), checked before anything is written.
function checkReplicas(dom, local, fds) {
  const copies = new Map();
  for (const loc of dom.replicas ?? []) {
    const key = JSON.stringify([loc.param, loc.file]);
    if (!copies.has(key)) copies.set(key, { param: loc.param, file: loc.file, locs: [] });
    copies.get(key).locs.push(loc);
  }
  for (const { param, file, locs } of copies.values()) {
    const master = local.get(param);
    const item = ITEMSIZE[locs[0].dtype];
    const copy = Buffer.concat(locs.map((loc) => {
      const { part } = masterPiece(loc, fds, `${dom.id}: replicas`);
      return readAt(part.fd, loc.data_offset + loc.element_offset * item, loc.numel * item);
    }));
    if (!master || !copy.equals(readRaw(master))) {
      throw new Refusal('CK243', file, `the copy of ${param}'s fp32 master differs from the master (domain ${dom.id})`,
        'restore the files of one save');
    }
  }
}

// Each domain's tensors: `local` (name -> a trainable parameter's master), `others` (its frozen
// parameters and buffers, under their names), `aliases`, `absent` (name -> why it is not written).
function domainTensors(dom, i, fds) {
  if (!dom.masters) {
    const { trainable, others, absent } = planManifest(dom.manifest, fds);
    return { local: new Map(trainable.map((t) => [t.name, t])), others, absent };
  }
  const { others, absent } = planManifest(dom.manifest, fds, false);
  // The model states whose module holds them, named as DeepSpeed names it (its role is `other` in a universal folder).
  const model = dom.manifest.files.find((f) => MODEL_STATES.test(f.path.split('/').at(-1)))?.path ?? 'its model states';
  for (const b of dom.manifest.buffers) {
    if (b.name in absent) absent[b.name] = `buffer: not located by the checkpoint index (in the pickled module of ${model})`;
  }
  const local = masterTensors(dom, i, fds);
  checkReplicas(dom, local, fds);
  return { local, others, absent };
}

// The whole tensor's stored bytes from its shards' (each read once, its digest checked when it has one).
function compose(t) {
  const { shape, name, shards } = t;
  const item = ITEMSIZE[t.dtype];
  const placement = shards[0].shard.placement;
  if (placement === 'whole' || placement === 'replicated') {
    const primary = shards.find(({ shard }) => shard.primary) ?? shards[0];
    const raw = readRaw(primary.local);
    for (const { shard, local } of shards) {
      if (local !== primary.local && !readRaw(local).equals(raw)) {
        throw new Refusal('CK401', name, `replicated parameter differs between domains (${shard.domain}: ${shard.local_name})`,
          'the files changed since validation, or the index does not describe them; run `ckptspec validate`');
      }
    }
    return raw;
  }
  const whole = Buffer.alloc(t.numel * item);
  const covered = new Uint8Array(t.numel);
  const put = (w, l, count, raw) => { // `count` elements of the shard at l, to the whole at w
    if (w + count > t.numel || (l + count) * item > raw.length) {
      throw new Refusal('CK401', name, `a shard's elements ${l}..${l + count - 1} fall outside it or the whole tensor`, REGENERATE);
    }
    if (covered.subarray(w, w + count).some((c) => c)) throw new Refusal('CK401', name, `the shards overlap at element ${w}`, REGENERATE);
    covered.fill(1, w, w + count);
    raw.copy(whole, w * item, l * item, (l + count) * item);
  };
  for (const { shard, local } of shards) {
    const raw = readRaw(local);
    if (shard.placement.split) {
      const { axis, offset, length } = shard.placement.split;
      const inner = product(shape.slice(axis + 1));
      for (let o = 0; o < product(shape.slice(0, axis)); o++) put((o * shape[axis] + offset) * inner, o * length * inner, length * inner, raw);
    } else {
      for (const { shape: dims, source: [wOff, wStrides], dest: [lOff, lStrides] } of shard.placement.pieces) {
        for (let k = 0; k < product(dims); k++) { // k: the row-major index into the piece's shape
          let [w, l, rest] = [wOff, lOff, k];
          for (let d = dims.length - 1; d >= 0; d--) {
            const i = rest % dims[d];
            rest = (rest - i) / dims[d];
            w += i * wStrides[d];
            l += i * lStrides[d];
          }
          put(w, l, 1, raw);
        }
      }
    }
  }
  const unset = covered.indexOf(0);
  if (unset >= 0) throw new Refusal('CK401', name, `the shards leave element ${unset} unset`, REGENERATE);
  return whole;
}

// An extra's shard (1.1, spec-checkpoint.md#extras): its domain's frozen parameter or buffer, or a layer file's bytes.
function extraShard(extra, shard, where, domains, fds) {
  const loc = shard.locator;
  if (!loc) {
    const local = domains.get(shard.domain).others.find((t) => t.name === shard.local_name && t.role === extra.role);
    if (!local) throw new Refusal('CK401', extra.name, `domain ${shard.domain} locates no ${extra.role} ${shard.local_name}`, REGENERATE);
    return { shard, local };
  }
  const fd = fds.get(shard.layer_file);
  if (fd === undefined) throw new Refusal('CK401', where, `locates ${extra.name} in ${shard.layer_file}, which the index does not list`, REGENERATE);
  checkMember(fd, shard.layer_file, loc);
  const piece = { part: { fd, loc }, start: 0, count: loc.numel };
  return { shard, local: { name: extra.name, shape: shard.local_shape, dtype: loc.dtype, numel: loc.numel, pieces: loc.numel ? [piece] : [] } };
}

// A 1.0 index places no frozen parameter, buffer or tie of a ZeRO domain: its pipeline layer files' keys that are
// no parameter's shard are named absent, a key that is another layer's parameter a tie of it (as ckptspec derives them).
function layerFileTies(index, absent) {
  const stageOf = new Map(index.domains.map((d) => [d.id, d.coordinate.pipeline]));
  const owner = new Map(index.parameters.flatMap((p) => p.shards.map((s) => [JSON.stringify([stageOf.get(s.domain), s.local_name]), p])));
  const ties = [];
  for (const lf of index.layer_files) {
    for (const [key, local] of Object.entries(lf.tensors)) {
      const whole = `${lf.layer}.${key}`;
      const p = owner.get(JSON.stringify([lf.pipeline, local]));
      if (!p) absent[whole] = `frozen parameter or buffer: not located by checkpoint index ${index.format_version} (in ${lf.path}; 1.1 locates it)`;
      else if (p.name !== whole) ties.push({ name: whole, owner: p.name, shape: p.shape });
    }
  }
  return ties;
}

function reconstructIndex(index, dir, out, checkHash) {
  index.domains.forEach((dom, i) => refuseUnreadable(dom.manifest, at(i), !dom.masters));
  const fds = openFiles(indexFiles(index), dir, checkHash);
  const domains = new Map(index.domains.map((dom, i) => [dom.id, domainTensors(dom, i, fds)]));
  const tensors = index.parameters.map((param) => {
    const shards = param.shards.map((shard) => ({ shard, local: domains.get(shard.domain).local.get(shard.local_name) }));
    const missing = shards.find(({ local }) => !local);
    if (missing) throw new Refusal('CK401', param.name, `domain ${missing.shard.domain} locates no ${missing.shard.local_name}`, REGENERATE);
    if (shards.some(({ local }) => local.dtype !== shards[0].local.dtype)) {
      throw new Refusal('CK401', param.name, 'its shards are of different dtypes', REGENERATE);
    }
    return { name: param.name, shape: param.shape, dtype: shards[0].local.dtype, numel: product(param.shape), shards };
  });
  (index.extras ?? []).forEach((extra, i) => {
    const shards = extra.shards.map((shard, j) => extraShard(extra, shard, `$.extras[${i}].shards[${j}]`, domains, fds));
    if (shards.some(({ local }) => local.dtype !== extra.dtype)) throw new Refusal('CK401', extra.name, 'its shards are of different dtypes', REGENERATE);
    tensors.push({ name: extra.name, shape: extra.shape, dtype: extra.dtype, numel: product(extra.shape), shards });
  });
  // A masters domain's frozen parameters, buffers and ties are named as in the whole model (stage 0, MoE's
  // dense domain, a universal folder), as ckptspec's whole plan adds them; a ZeRO domain's are local names,
  // placed by the index's `extras` (1.1) or by nothing (1.0: absent).
  const names = new Set(tensors.map((t) => t.name));
  const absent = {};
  const aliases = [];
  for (const [i, dom] of index.domains.entries()) {
    const { others, absent: notWritten } = domains.get(dom.id);
    if (!dom.masters) {
      if (!index.extras) {
        for (const t of others) absent[t.name] = `${t.role}: not placed by checkpoint index ${index.format_version} (1.1 places it)`;
        for (const a of dom.manifest.aliases) absent[a.name] = `tie of ${a.owner}: not placed by checkpoint index ${index.format_version} (1.1 places it)`;
      }
      Object.assign(absent, notWritten);
      continue;
    }
    for (const t of others) {
      if (names.has(t.name)) throw new Refusal('CK401', `${at(i)}: ${t.name}`, 'names two tensors of the whole model', REGENERATE);
      names.add(t.name);
      tensors.push(t);
    }
    Object.assign(absent, notWritten);
    aliases.push(...dom.manifest.aliases);
  }
  if (index.extras) {
    const byName = new Map(tensors.map((t) => [t.name, t]));
    for (const [name, owner] of Object.entries(index.aliases ?? {})) aliases.push({ name, owner, shape: byName.get(owner)?.shape });
  } else if (index.layer_files.length) aliases.push(...layerFileTies(index, absent));
  const tied = addAliases(tensors, aliases, absent);
  const { pipeline, tensor, data } = index.topology.degrees;
  const metadata = {
    format: 'pt',
    'ckptspec.index_format_version': index.format_version,
    'ckptspec.dtype': 'float32',
    'ckptspec.parallel': `pp${pipeline}-tp${tensor}-dp${data}`,
    'ckptspec.aliases': JSON.stringify(tied),
    'ckptspec.untied': 'true',
    'ckptspec.absent': JSON.stringify(absent),
  };
  writeStateDict(out, tensors, metadata, (t) => {
    if (!t.shards) return readTensor(t);
    const raw = compose(t);
    return OUTPUT_DTYPE[t.dtype] === 'float32' ? toFloat32(raw, t.dtype) : raw;
  });
  return { tensors: tensors.length, aliases: Object.keys(tied).length, absent: Object.keys(absent) };
}

module.exports = { reconstructIndex, compose };
