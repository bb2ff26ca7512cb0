'use strict';
// A torch DCP document (docs/spec-dcp.md, format `ckptspec.dcp` 1.0): what a reader checks before it uses any field,
// in ckptspec's order (format/dcp_validate.py), and every tensor rebuilt from it. The checkpoint's `.metadata` (a
// pickle) is never read: the document says where each chunk's elements are (`data_offset`).
//   1. the format-version gate: another major stops everything (CK003), a newer minor is a warning (CK004);
//   2. the JSON Schema (schema/dcp-1.0.schema.json, ajv);
//   3. the rules CK701-CK705 (docs/errors.md), which the schema cannot express.
const crypto = require('crypto');
const fs = require('fs');
const path = require('path');
const Ajv2020 = require('ajv/dist/2020');
const { SCHEMA_DIR, SEMVER, finding, jsonPath, unsafeIntegers, schemaFindings } = require('./check');
const { ITEMSIZE, SAFETENSORS, WIDENABLE, toFloat32 } = require('./dtypes');
const { Refusal } = require('./files');
const { writeSafetensors } = require('./safetensors');

const DCP_SCHEMA_FILE = path.join(SCHEMA_DIR, 'dcp-1.0.schema.json');
const DCP = { format: 'ckptspec.dcp', major: 1, minor: 0 };
const RANK_FILE = /^__(0|[1-9][0-9]*)_(0|[1-9][0-9]*)\.distcp$/;

const isDcp = (doc) => doc !== null && typeof doc === 'object' && doc.format === DCP.format;

function compileDcpSchema(warnings = []) {
  const note = (...args) => warnings.push(args.join(' '));
  const ajv = new Ajv2020({ strict: true, allErrors: true, logger: { log: note, warn: note, error: note } });
  return ajv.compile(JSON.parse(fs.readFileSync(DCP_SCHEMA_FILE, 'utf8')));
}

function dcpVersionGate(doc) {
  const version = doc.format_version;
  if (typeof version !== 'string' || !SEMVER.test(version)) return { findings: [], stop: false, newerMinor: false };
  const [major, minor] = version.split('.').map(Number);
  if (major !== DCP.major) {
    return { stop: true, newerMinor: false, findings: [finding('CK003', '$.format_version',
      `DCP document version ${version} has major ${major}; this reader understands ${DCP.major}`,
      'use a reader for that major version')] };
  }
  if (minor > DCP.minor) {
    return { stop: false, newerMinor: true, findings: [finding('CK004', '$.format_version',
      `DCP document version ${version} is newer than ${DCP.major}.${DCP.minor}; unknown fields are ignored`,
      'a newer reader checks every field', 'warning')] };
  }
  return { findings: [], stop: false, newerMinor: false };
}

// ---- the rules (format/dcp_rules.py); they assume a schema-valid document

const prod = (shape) => shape.reduce((a, d) => a * d, 1);
const COVER_HINT = "a tensor's chunks cover it exactly once, as the .metadata of the save says";

// CK701: a tensor's chunks lie inside it, do not overlap and hold all of its elements.
function chunkCoverage(doc, add) {
  doc.tensors.forEach((t, ti) => {
    const inside = (c) => c.offsets.length === t.shape.length && c.sizes.length === t.shape.length
      && c.offsets.every((o, d) => o + c.sizes[d] <= t.shape[d]);
    let outside = 0;
    t.chunks.forEach((c, ci) => {
      if (inside(c)) return;
      outside += 1;
      add('CK701', ['tensors', ti, 'chunks', ci], `chunk at ${JSON.stringify(c.offsets)} of sizes ${JSON.stringify(c.sizes)} lies outside ${JSON.stringify(t.shape)}`, COVER_HINT);
    });
    if (outside) return;
    const overlap = (a, b) => a.offsets.every((o, d) => o < b.offsets[d] + b.sizes[d] && b.offsets[d] < o + a.sizes[d]);
    const nonEmpty = t.chunks.filter((c) => prod(c.sizes));
    let overlapping = 0;
    nonEmpty.forEach((a, i) => nonEmpty.slice(i + 1).forEach((b) => { if (overlap(a, b)) overlapping += 1; }));
    if (overlapping) {
      add('CK701', ['tensors', ti, 'chunks'], `${overlapping} pairs of chunks overlap`, COVER_HINT);
      return;
    }
    const held = t.chunks.reduce((s, c) => s + prod(c.sizes), 0);
    if (held !== prod(t.shape)) add('CK701', ['tensors', ti, 'chunks'], `the chunks hold ${held} of the tensor's ${prod(t.shape)} elements (a gap)`, COVER_HINT);
  });
}

// CK702: names of their own; files listed once, by a plain file name.
function names(doc, add) {
  const seen = new Set();
  for (const kind of ['tensors', 'bytes']) {
    doc[kind].forEach((e, i) => {
      if (seen.has(e.name)) add('CK702', [kind, i, 'name'], `${JSON.stringify(e.name)} names another entry too`, 'a state dict key names one entry');
      seen.add(e.name);
    });
  }
  const paths = new Set();
  doc.files.forEach((f, i) => {
    if (f.path.includes('/') || f.path.includes('\\') || ['.', '..', '.metadata'].includes(f.path)) {
      add('CK702', ['files', i, 'path'], `${JSON.stringify(f.path)} is not a file name beside .metadata`, 'DCP writes its files in the checkpoint directory');
    } else if (paths.has(f.path)) add('CK702', ['files', i, 'path'], `${f.path} is listed twice`, 'list each file once');
    paths.add(f.path);
  });
}

function items(doc) {
  const out = [];
  doc.tensors.forEach((t, ti) => t.chunks.forEach((c, ci) => out.push([['tensors', ti, 'chunks', ci], c, prod(c.sizes) * ITEMSIZE[t.dtype]])));
  doc.bytes.forEach((b, bi) => out.push([['bytes', bi], b, 0]));
  return out;
}

// CK703: every item in a listed file and inside it (one finding per file cut short); a chunk's elements inside its item.
function itemPlace(doc, add) {
  const sizes = new Map(doc.files.map((f) => [f.path, f.size]));
  const past = new Map();
  for (const [parts, item, nbytes] of items(doc)) {
    const size = sizes.get(item.file);
    const end = item.offset + item.length;
    if (size === undefined) add('CK703', [...parts, 'file'], `${item.file} is not in files`, 'list every file an item names');
    else if (end > size) { if (!past.has(item.file)) past.set(item.file, []); past.get(item.file).push([parts, end]); }
    if ('data_offset' in item && !(item.offset <= item.data_offset && item.data_offset <= end - nbytes)) {
      add('CK703', [...parts, 'data_offset'], `the chunk's ${nbytes} bytes at ${item.data_offset} are not inside its item`, "a chunk's elements are inside its torch.save record");
    }
  }
  for (const [name, list] of past) {
    add('CK703', [...list[0][0], 'length'], `${list.length} items end past the ${sizes.get(name)} bytes of ${name}`, 'an item lies inside its file');
  }
}

// CK704: no two items share a byte of their file.
function itemOverlap(doc, add) {
  const byFile = new Map();
  for (const [parts, item] of items(doc)) {
    if (!item.length) continue;
    if (!byFile.has(item.file)) byFile.set(item.file, []);
    byFile.get(item.file).push([item.offset, item.offset + item.length, parts]);
  }
  for (const [name, spans] of byFile) {
    spans.sort((a, b) => a[0] - b[0] || a[1] - b[1]);
    let reported = 0;
    for (let i = 1; i < spans.length && reported < 4; i++) {
      if (spans[i][0] < spans[i - 1][1]) {
        reported += 1;
        add('CK704', [...spans[i][2], 'offset'], `the item at byte ${spans[i][0]} of ${name} overlaps the one before`, 'each item has bytes of its own');
      }
    }
  }
}

// CK705: a file named for a rank names one of the saving world.
function worldSize(doc, add) {
  if (doc.world_size === undefined) return;
  doc.files.forEach((f, i) => {
    const m = RANK_FILE.exec(f.path);
    if (m && Number(m[1]) >= doc.world_size) add('CK705', ['files', i, 'path'], `${f.path} was written by rank ${m[1]}, outside world_size ${doc.world_size}`, 'the ranks are 0 .. world_size - 1');
  });
}

const DCP_RULES = [chunkCoverage, names, itemPlace, itemOverlap, worldSize];

function checkDcp(validate, doc) {
  const gate = dcpVersionGate(doc);
  if (gate.stop) return gate.findings;
  const found = [...gate.findings, ...unsafeIntegers(doc), ...schemaFindings(validate, doc, gate.newerMinor)];
  if (found.some((f) => f.severity === 'error')) return found;
  const add = (code, parts, message, hint) => found.push(finding(code, jsonPath(parts), message, hint));
  for (const rule of DCP_RULES) rule(doc, add);
  return found;
}

// ---- every tensor of a checked document, from its chunks' elements, into OUT.safetensors

function readAt(fd, start, length) {
  const buf = Buffer.alloc(length);
  for (let done = 0; done < length;) {
    const n = fs.readSync(fd, buf, done, length - done, start + done);
    if (!n) throw new Refusal('CK256', 'file', 'ends inside a chunk', 'the file changed while read');
    done += n;
  }
  return buf;
}

// The files the document lists, open, each of its size (and hash when recorded and checked): CK256.
function openDcpFiles(doc, dir, checkHash) {
  const fds = new Map();
  doc.files.forEach((f, i) => {
    const file = path.join(dir, f.path);
    const where = `${dir}: ${f.path}: ${jsonPath(['files', i])}`;
    const stat = fs.statSync(file, { throwIfNoEntry: false });
    const hint = 'the file is not the one the document describes: restore it, or describe the directory again';
    if (!stat) throw new Refusal('CK256', where, `${f.path} is missing`, hint);
    if (stat.size !== f.size) throw new Refusal('CK256', where, `holds ${stat.size} bytes, not ${f.size}`, hint);
    if (checkHash && f.hash) {
      const got = crypto.createHash(f.hash.algorithm === 'blake2b' ? 'blake2b512' : 'sha256').update(fs.readFileSync(file)).digest('hex');
      if (got !== f.hash.digest) throw new Refusal('CK256', where, `its ${f.hash.algorithm} is ${got.slice(0, 12)}..., not ${f.hash.digest.slice(0, 12)}...`, hint);
    }
    fds.set(f.path, fs.openSync(file, 'r'));
  });
  return fds;
}

// A chunk's row-major elements copied into the whole tensor's bytes: one copy per row of its last dimension.
function place(whole, shape, chunk, data, itemsize) {
  const nd = shape.length;
  if (nd === 0) { data.copy(whole, 0); return; }
  const strides = shape.map((_, d) => prod(shape.slice(d + 1)));
  const row = chunk.sizes[nd - 1] * itemsize;
  const outer = chunk.sizes.slice(0, nd - 1);
  const index = outer.map(() => 0);
  for (let src = 0; src < data.length; src += row) {
    let dst = chunk.offsets[nd - 1];
    index.forEach((i, d) => { dst += (chunk.offsets[d] + i) * strides[d]; });
    data.copy(whole, dst * itemsize, src, src + row);
    for (let d = outer.length - 1; d >= 0; d--) { if (++index[d] < outer[d]) break; index[d] = 0; }
  }
}

function reconstructDcp(doc, dir, out, checkHash) {
  const fds = openDcpFiles(doc, dir, checkHash);
  try {
    const tensors = doc.tensors.map((t, ti) => {
      const outDtype = SAFETENSORS[t.dtype] ? t.dtype : WIDENABLE.has(t.dtype) ? 'float32' : null;
      if (!outDtype) throw new Refusal('CK402', jsonPath(['tensors', ti, 'dtype']), `${t.name}: ${t.dtype} is not written by this reader`, 'use ckptspec reconstruct');
      const numel = prod(t.shape);
      return { name: t.name, shape: t.shape, source: t, index: ti, out: outDtype, nbytes: numel * ITEMSIZE[outDtype] };
    });
    const metadata = { format: 'pt', 'ckptspec.format': DCP.format, 'ckptspec.format_version': doc.format_version };
    writeSafetensors(out, tensors, metadata, ({ source: t, index: ti, out: outDtype }) => {
      const itemsize = ITEMSIZE[t.dtype];
      const whole = Buffer.alloc(prod(t.shape) * itemsize);
      t.chunks.forEach((c, ci) => {
        const data = readAt(fds.get(c.file), c.data_offset, prod(c.sizes) * itemsize);
        if (checkHash && c.digest) {
          const got = crypto.createHash('sha256').update(data).digest('hex');
          if (got !== c.digest.sha256) {
            throw new Refusal('CK257', `${dir}: ${c.file}: ${jsonPath(['tensors', ti, 'chunks', ci, 'digest'])}`,
              `${t.name}: the chunk at ${JSON.stringify(c.offsets)} hashes to ${got.slice(0, 12)}..., not ${c.digest.sha256.slice(0, 12)}...`,
              'the chunk changed since the document was made: restore the file');
          }
        }
        place(whole, t.shape, c, data, itemsize);
      });
      return outDtype === t.dtype ? whole : toFloat32(whole, t.dtype);
    });
    return { tensors: tensors.length, aliases: 0, absent: [] };
  } finally {
    for (const fd of fds.values()) fs.closeSync(fd);
  }
}

module.exports = { DCP_SCHEMA_FILE, isDcp, compileDcpSchema, checkDcp, reconstructDcp };
