'use strict';
// Where each tensor of a 1.x manifest is: the manifest's locators (docs/spec.md#locators) turned into
// element ranges of the .pt files, every master partition (and, format 1.1, every frozen parameter
// and buffer: spec.md#tensor-locators) checked against its zip header first. Used for a manifest,
// and for each domain of a checkpoint index (index.js).
const crypto = require('crypto');
const { Refusal, readAt, checkMember } = require('./files');
const { ITEMSIZE, WIDENABLE, OUTPUT_DTYPE, toFloat32 } = require('./dtypes');

// What this reader cannot read, refused before any file is opened. `at`: the manifest's JSON path
// ('$', or '$.domains[i].manifest' inside an index); `partitions`: whether its masters must be
// located by 1.x partitions (an index domain's `masters` locates them otherwise).
function refuseUnreadable(manifest, at = '$', partitions = true) {
  const { layout } = manifest;
  if ((layout.byte_order ?? 'little') !== 'little') { // spec.md#byte-order: a reader checks it
    throw new Refusal('CK402', `${at}.layout.byte_order`, `${layout.byte_order} byte order`, 'this reader reads little-endian bytes');
  }
  if (!WIDENABLE.has(layout.master_dtype)) {
    throw new Refusal('CK402', `${at}.layout.master_dtype`, `${layout.master_dtype} masters cannot be widened to float32 here`,
      'float32, float16 and bfloat16 masters are supported');
  }
  if (partitions && manifest.groups.some((g) => g.params.length) && !manifest.files.some((f) => f.partitions.length)) {
    throw new Refusal('CK402', `${at}.files`, 'the manifest locates no partition',
      'generate the manifest from the checkpoint: `ckptspec generate CHECKPOINT`');
  }
}

// (group, rank) -> {fd, file, loc} for every master partition (spec.md#locators; CK116 made them
// complete), and name -> [{fd, file, loc}] in rank order for every frozen parameter and buffer
// (format 1.1, spec.md#tensor-locators; CK121 made them complete).
function locate(manifest, fds) {
  const located = new Map();
  const named = new Map();
  for (const f of manifest.files) {
    for (const loc of f.partitions) {
      checkMember(fds.get(f.path), f.path, loc);
      located.set(`${loc.group}/${loc.rank}`, { fd: fds.get(f.path), file: f.path, loc });
    }
    for (const loc of f.tensors ?? []) {
      checkMember(fds.get(f.path), f.path, loc);
      named.set(loc.name, [...(named.get(loc.name) ?? []), { fd: fds.get(f.path), file: f.path, loc, rank: f.ranks[0] ?? 0 }]);
    }
  }
  for (const parts of named.values()) parts.sort((a, b) => a.rank - b.rank);
  return { located, named };
}

// spec.md#reconstruction: the [start, start + count) element ranges of each rank's partition that
// hold parameter p, in order.
function pieces(group, g, p, located) {
  const P = group.partition_count;
  const out = [];
  for (let r = 0; r < P; r++) {
    const part = located.get(`${g}/${r}`);
    if (group.partitioning === 'flat') {
      // Rank r holds elements [r * partition_numel, r * partition_numel + saved) of the group buffer.
      const lo = r * group.partition_numel;
      const a = Math.max(p.offset, lo);
      const b = Math.min(p.offset + p.numel, lo + part.loc.numel);
      if (a < b) out.push({ part, start: a - lo, count: b - a });
    } else {
      // per_param (stage 3): every rank holds a `share` of p at p.offset; the last share ends in padding.
      const share = (p.numel + p.padding) / P;
      const count = Math.max(0, Math.min(share, p.numel - r * share));
      if (count) out.push({ part, start: p.offset, count });
    }
  }
  const got = out.reduce((n, x) => n + x.count, 0);
  if (got !== p.numel || out.some((x) => x.start + x.count > x.part.loc.numel)) {
    throw new Refusal('CK401', p.name, `the partitions hold ${got} of its ${p.numel} elements`,
      'run `ckptspec validate` and regenerate the manifest');
  }
  return out;
}

// A frozen parameter or buffer through its named locators: their elements back to back, in rank order.
function namedPieces(name, numel, dtype, parts) {
  const got = parts.reduce((n, { loc }) => n + loc.numel, 0);
  if (got !== numel || parts.some(({ loc }) => loc.dtype !== dtype)) {
    throw new Refusal('CK401', name, `the locators hold ${got} elements, the tensor has ${numel}`,
      'run `ckptspec validate` and regenerate the manifest');
  }
  return parts.filter(({ loc }) => loc.numel).map((part) => ({ part, start: 0, count: part.loc.numel }));
}

// The tensor's stored bytes, checked against its digest (spec.md#digests: sha256 of the real
// elements, little-endian, as stored).
function readRaw(t) {
  const item = ITEMSIZE[t.dtype];
  const raw = Buffer.concat(t.pieces.map(({ part, start, count }) =>
    readAt(part.fd, part.loc.data_offset + (part.loc.element_offset + start) * item, count * item)));
  if (t.digest) {
    const actual = crypto.createHash('sha256').update(raw).digest('hex');
    if (actual !== t.digest) {
      throw new Refusal('CK222', t.name, `sha256 of the tensor's elements is ${actual.slice(0, 16)}..., the manifest records `
        + `${t.digest.slice(0, 16)}...`, 'the tensor changed after the manifest was written; restore its file');
    }
  }
  return raw;
}

// ... widened to float32 when floating.
function readTensor(t) {
  const raw = readRaw(t);
  return OUTPUT_DTYPE[t.dtype] === 'float32' ? toFloat32(raw, t.dtype) : raw;
}

const product = (shape) => shape.reduce((a, d) => a * d, 1);

// The manifest's tensors: `trainable` (each parameter's master, through the partitions; `masters`
// false: none, an index domain that locates them apart), `others` (frozen parameters and buffers
// through their locators; a 1.0 manifest has none) and `absent` (name -> why it is not written).
function planManifest(manifest, fds, masters = true) {
  const { located, named } = locate(manifest, fds);
  const sha = (d) => d?.sha256;
  const trainable = masters ? manifest.groups.flatMap((group, g) => group.params.map((p) => (
    { name: p.name, shape: p.shape, dtype: manifest.layout.master_dtype, numel: p.numel, digest: sha(p.digest),
      pieces: pieces(group, g, p, located) }))) : [];
  const others = [];
  const absent = {};
  for (const [section, role] of [['frozen', 'frozen'], ['buffers', 'buffer']]) {
    for (const t of manifest[section]) {
      const numel = section === 'frozen' ? t.numel : product(t.shape);
      if (!named.has(t.name)) {
        absent[t.name] = `${role}: not located by the manifest (format ${manifest.format_version})`;
        continue;
      }
      if (!OUTPUT_DTYPE[t.dtype]) {
        throw new Refusal('CK402', t.name, `${t.dtype} tensors are not written by this reader`, 'use `ckptspec reconstruct`');
      }
      others.push({ name: t.name, role, shape: t.shape, dtype: t.dtype, numel, digest: sha(t.digest),
        pieces: namedPieces(t.name, numel, t.dtype, named.get(t.name)) });
    }
  }
  for (const e of manifest.excluded) absent[e.name] = `excluded: ${e.reason}`;
  return { trainable, others, absent };
}

// Aliases: a copy of their owner under their own name (as `ckptspec reconstruct --untie`), the tie
// in the metadata. Appends them to `tensors`; returns alias -> owner of those written.
function addAliases(tensors, aliases, absent) {
  const byName = new Map(tensors.map((t) => [t.name, t]));
  const written = {};
  for (const a of aliases) {
    const owner = byName.get(a.owner);
    if (owner) {
      written[a.name] = a.owner;
      tensors.push({ ...owner, name: a.name, shape: a.shape, owner: a.owner });
    } else {
      absent[a.name] = `alias of ${a.owner}, which is not written`;
    }
  }
  return written;
}

module.exports = { refuseUnreadable, locate, pieces, namedPieces, readRaw, readTensor, planManifest, addAliases, product };
