#!/usr/bin/env node
'use strict';
// Rebuild the full state dict of a DeepSpeed ZeRO checkpoint from its ckptspec manifest, in plain
// Node.js: no torch, no pickle, no zip parsing. The manifest's locators (docs/spec.md#locators)
// give the byte offset of every rank's flat master partition inside the .pt files, and (format
// 1.1, docs/spec.md#tensor-locators) of every frozen parameter and buffer.
//
//   node reader.js [--no-hash] MANIFEST.json CHECKPOINT OUT.safetensors
//
// CHECKPOINT is the directory the manifest's file paths are relative to (the tag directory), or
// the save directory above it, whose `latest` file names the tag. Exit status: 0 written,
// 1 invalid manifest or checkpoint files, 2 usage or I/O error. Nothing is written unless all is well.
// Every key is written (tied aliases as copies of their owner); floating tensors as float32.
const crypto = require('crypto');
const fs = require('fs');
const path = require('path');
const { compileSchemas, checkManifest } = require('./check');
const { ITEMSIZE, WIDENABLE, OUTPUT_DTYPE, toFloat32 } = require('./dtypes');
const { writeSafetensors } = require('./safetensors');

const USAGE = 'usage: node reader.js [--no-hash] MANIFEST.json CHECKPOINT OUT.safetensors';

// A refusal: one line with a ckptspec error code, what it is about and a hint.
class Refusal extends Error {
  constructor(code, where, message, hint, status = 1) {
    super(`${where}: ${code} ${message} (hint: ${hint})`);
    this.status = status;
  }
}

function readManifest(file) {
  let bytes;
  try {
    bytes = fs.readFileSync(file);
  } catch (err) {
    throw new Refusal('CK901', file, err.code === 'ENOENT' ? 'file not found' : err.message, 'check the path', 2);
  }
  let text;
  try {
    text = new TextDecoder('utf-8', { fatal: true }).decode(bytes); // refuse, don't read U+FFFD
  } catch {
    throw new Refusal('CK903', file, 'not UTF-8 text', 'save the manifest as UTF-8 JSON', 2);
  }
  try {
    return JSON.parse(text);
  } catch (err) {
    throw new Refusal('CK903', file, `not valid JSON: ${err.message}`,
      'pass a JSON manifest (`ckptspec convert` makes one from msgpack)', 2);
  }
}

// The tag directory: CHECKPOINT itself, or the tag its `latest` file names (DeepSpeed's layout).
function tagDirectory(checkpoint) {
  const latest = path.join(checkpoint, 'latest');
  return fs.existsSync(latest) ? path.join(checkpoint, fs.readFileSync(latest, 'utf8').trim()) : checkpoint;
}

function readAt(fd, position, length) {
  const out = Buffer.alloc(length);
  for (let done = 0; done < length;) {
    const n = fs.readSync(fd, out, done, length - done, position + done);
    if (n === 0) throw new Refusal('CK208', `fd ${fd}`, `ends before byte ${position + length}`, 'a file changed while it was read');
    done += n;
  }
  return out;
}

// Files: size first (a truncated shard is the common damage, spec.md#files), then the hash.
function openFiles(manifest, dir, checkHash) {
  const fds = new Map();
  for (const f of manifest.files) {
    const full = path.join(dir, ...f.path.split('/')); // CK113 already refused paths that leave dir
    let size;
    try {
      size = fs.statSync(full).size;
    } catch (err) {
      if (err.code !== 'ENOENT') throw err; // permissions, I/O: reported by main() with exit 2
      throw new Refusal('CK206', f.path, 'is missing from the checkpoint directory', 'restore the file from the run that wrote it');
    }
    if (size !== f.size) throw new Refusal('CK208', f.path, `is ${size} bytes, the manifest says ${f.size}`,
      'the file was cut off or replaced; restore it');
    const fd = fs.openSync(full, 'r');
    if (checkHash && f.hash) {
      const hash = crypto.createHash(f.hash.algorithm === 'blake2b' ? 'blake2b512' : 'sha256');
      for (let at = 0; at < size; at += 1 << 24) hash.update(readAt(fd, at, Math.min(1 << 24, size - at)));
      if (hash.digest('hex') !== f.hash.digest) throw new Refusal('CK209', f.path, `${f.hash.algorithm} differs from the manifest`,
        'restore the file the manifest describes');
    }
    fds.set(f.path, fd);
  }
  return fds;
}

// spec.md#locators: data_offset is where the member's bytes start, just past its zip local header
// (30 bytes, the name, an extra field). One read confirms the header is there, names the member and
// says "stored" (method 0): a locator made for other files cannot send us into the wrong bytes.
function checkMember(fd, file, loc) {
  const name = Buffer.from(loc.member, 'utf8');
  const span = Math.min(loc.data_offset, 30 + name.length + 0xffff);
  const bytes = readAt(fd, loc.data_offset - span, span);
  for (let h = span - 30 - name.length; h >= 0; h--) {
    if (bytes.readUInt32LE(h) === 0x04034b50 && bytes.readUInt16LE(h + 26) === name.length
        && h + 30 + name.length + bytes.readUInt16LE(h + 28) === span && bytes.subarray(h + 30, h + 30 + name.length).equals(name)) {
      if (bytes.readUInt16LE(h + 8) === 0) return;
      throw new Refusal('CK214', file, `member ${loc.member} is compressed`,
        'torch.save stores members uncompressed; re-save the checkpoint');
    }
  }
  throw new Refusal('CK214', file, `no zip entry ${loc.member} ends at byte ${loc.data_offset}`,
    'regenerate the manifest from these files');
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

// The tensor's stored bytes, checked against its digest (spec.md#digests: sha256 of the real
// elements, little-endian, as stored), then widened to float32 when floating.
function readTensor(t) {
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
  return OUTPUT_DTYPE[t.dtype] === 'float32' ? toFloat32(raw, t.dtype) : raw;
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

function reconstruct(manifest, dir, out, checkHash) {
  const { layout } = manifest;
  if (layout.tensor_parallel_size !== 1 || layout.pipeline_parallel_size !== 1) {
    throw new Refusal('CK402', '$.layout', 'the manifest describes one model-parallel rank, not the whole model',
      'this reader handles data parallelism only');
  }
  if ((layout.byte_order ?? 'little') !== 'little') { // spec.md#byte-order: a reader checks it
    throw new Refusal('CK402', '$.layout.byte_order', `${layout.byte_order} byte order`, 'this reader reads little-endian bytes');
  }
  if (!WIDENABLE.has(layout.master_dtype)) {
    throw new Refusal('CK402', '$.layout.master_dtype', `${layout.master_dtype} masters cannot be widened to float32 here`,
      'float32, float16 and bfloat16 masters are supported');
  }
  if (manifest.groups.some((g) => g.params.length) && !manifest.files.some((f) => f.partitions.length)) {
    throw new Refusal('CK402', '$.files', 'the manifest locates no partition',
      'generate the manifest from the checkpoint: `ckptspec generate CHECKPOINT`');
  }
  const fds = openFiles(manifest, dir, checkHash);
  const { located, named } = locate(manifest, fds);
  const sha = (d) => d?.sha256;
  const tensors = manifest.groups.flatMap((group, g) => group.params.map((p) => (
    { name: p.name, shape: p.shape, dtype: layout.master_dtype, numel: p.numel, digest: sha(p.digest),
      pieces: pieces(group, g, p, located) })));
  // Frozen parameters and buffers: through their locators (format 1.1); a 1.0 manifest has none.
  const absent = {};
  const product = (shape) => shape.reduce((a, d) => a * d, 1);
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
      tensors.push({ name: t.name, shape: t.shape, dtype: t.dtype, numel, digest: sha(t.digest),
        pieces: namedPieces(t.name, numel, t.dtype, named.get(t.name)) });
    }
  }
  for (const e of manifest.excluded) absent[e.name] = `excluded: ${e.reason}`;
  // Aliases: a copy of their owner under their own name (as `ckptspec reconstruct --untie`), the tie in the metadata.
  const byName = new Map(tensors.map((t) => [t.name, t]));
  const aliases = {};
  for (const a of manifest.aliases) {
    const owner = byName.get(a.owner);
    if (owner) {
      aliases[a.name] = a.owner;
      tensors.push({ ...owner, name: a.name, shape: a.shape, owner: a.owner });
    } else {
      absent[a.name] = `alias of ${a.owner}, which is not written`;
    }
  }
  for (const t of tensors) {
    t.out = OUTPUT_DTYPE[t.dtype];
    t.nbytes = t.numel * ITEMSIZE[t.out];
  }
  const metadata = {
    format: 'pt',
    'ckptspec.format_version': manifest.format_version,
    'ckptspec.dtype': 'float32',
    'ckptspec.aliases': JSON.stringify(aliases),
    'ckptspec.untied': 'true',
    'ckptspec.absent': JSON.stringify(absent),
  };
  const tied = new Set(Object.values(aliases));
  const kept = new Map(); // the owners' bytes, read and checked once, copied for their aliases
  try {
    writeSafetensors(out, tensors, metadata, (t) => {
      if (t.owner) return kept.get(t.owner);
      const bytes = readTensor(t);
      if (tied.has(t.name)) kept.set(t.name, bytes);
      return bytes;
    });
  } catch (err) {
    if (err instanceof Refusal) throw err;
    throw new Refusal('CK906', out, `cannot write: ${err.message}`, 'check the output path and free space', 2);
  }
  return { tensors: tensors.length, aliases: Object.keys(aliases).length, absent: Object.keys(absent) };
}

function main(argv) {
  const checkHash = !argv.includes('--no-hash');
  const args = argv.filter((a) => a !== '--no-hash');
  if (args.length !== 3 || args.some((a) => a.startsWith('-'))) {
    process.stderr.write(`${USAGE}\n`);
    return 2;
  }
  const [manifestFile, checkpoint, out] = args;
  try {
    const manifest = readManifest(manifestFile);
    const findings = checkManifest(compileSchemas(), manifest);
    for (const f of findings) {
      const label = f.severity === 'error' ? f.code : `${f.code} warning:`;
      process.stderr.write(`${manifestFile}: ${f.where}: ${label} ${f.message} (hint: ${f.hint})\n`);
    }
    if (findings.some((f) => f.severity === 'error')) return 1;
    if (!fs.statSync(checkpoint, { throwIfNoEntry: false })?.isDirectory()) {
      throw new Refusal('CK901', checkpoint, 'is not a directory', 'pass the checkpoint (save or tag) directory', 2);
    }
    const done = reconstruct(manifest, tagDirectory(checkpoint), out, checkHash);
    process.stdout.write(`${out}: ${done.tensors} tensors (${done.aliases} of them tied aliases, written as copies)\n`);
    if (done.absent.length) process.stdout.write(`not in the output (see its ckptspec.absent metadata): ${done.absent.join(', ')}\n`);
    return 0;
  } catch (err) {
    if (typeof err.code === 'string' && err.syscall) { // an I/O error (EACCES, EIO...) on a shard
      process.stderr.write(`${err.path ?? checkpoint}: CK901 ${err.message} (hint: check the files and their permissions)\n`);
      return 2;
    }
    if (!(err instanceof Refusal)) throw err; // a bug in this reader: let Node print the stack
    process.stderr.write(`${err.message}\n`);
    return err.status;
  }
}

if (require.main === module) process.exitCode = main(process.argv.slice(2));
