'use strict';
// The reader's I/O: the document, the tag directory, positioned reads, the files a document lists
// (size, then hash) and the zip header check behind every locator. Every refusal is a `Refusal`:
// one line with a ckptspec error code, what it is about and a hint (docs/errors.md).
const crypto = require('crypto');
const fs = require('fs');
const path = require('path');

class Refusal extends Error {
  constructor(code, where, message, hint, status = 1) {
    super(`${where}: ${code} ${message} (hint: ${hint})`);
    this.status = status;
  }
}

// A manifest or a checkpoint index: UTF-8 JSON.
function readDocument(file) {
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

// What a file that is missing or not the listed one is, by the kind of entry that lists it: a
// manifest's (or a domain manifest's) file, an index's pipeline layer file or MoE expert file.
const DAMAGE = {
  file: {
    missing: (f) => new Refusal('CK206', f.path, 'is missing from the checkpoint directory', 'restore the file from the run that wrote it'),
    size: (f, size) => new Refusal('CK208', f.path, `is ${size} bytes, the manifest says ${f.size}`, 'the file was cut off or replaced; restore it'),
    hash: (f) => new Refusal('CK209', f.path, `${f.hash.algorithm} differs from the manifest`, 'restore the file the manifest describes'),
  },
  layer: {
    missing: (f) => new Refusal('CK230', `${f.path}: ${f.at}`, `pipeline layer file of layer ${f.layer} (stage ${f.pipeline}) is missing`,
      'restore it from the run that wrote the checkpoint'),
    size: (f) => DAMAGE.layer.hash(f),
    hash: (f) => new Refusal('CK230', `${f.path}: ${f.at}`, 'pipeline layer file changed since the index was written (size or hash)',
      'restore the file of this save (a layer file of another layer or save?)'),
  },
  expert: {
    missing: (f) => new Refusal('CK240', `${f.path}: ${f.at}`, `expert file of MoE layer ${f.moe_layer}, expert ${f.expert} `
      + `(expert-parallel rank ${f.expert_parallel_rank}) is missing`,
    'restore it from the run that wrote the checkpoint; that expert\'s weights are lost without it'),
    size: (f) => DAMAGE.expert.hash(f),
    hash: (f) => new Refusal('CK241', `${f.path}: ${f.at}`, `expert file of expert ${f.expert} changed since the index was written (size or hash)`,
      'an expert file of another expert or save: restore the file of this save'),
  },
};

// Files: size first (a truncated shard is the common damage, spec.md#files), then the hash.
// entries: [{path, size, hash?, damage?: 'file' | 'layer' | 'expert', ...}]; returns path -> fd.
function openFiles(entries, dir, checkHash) {
  const fds = new Map();
  for (const f of entries) {
    const damage = DAMAGE[f.damage ?? 'file'];
    const full = path.join(dir, ...f.path.split('/')); // CK113 already refused paths that leave dir
    let size;
    try {
      size = fs.statSync(full).size;
    } catch (err) {
      if (err.code !== 'ENOENT') throw err; // permissions, I/O: reported by main() with exit 2
      throw damage.missing(f);
    }
    if (size !== f.size) throw damage.size(f, size);
    const fd = fs.openSync(full, 'r');
    fds.set(f.path, fd);
    if (checkHash && f.hash) {
      const hash = crypto.createHash(f.hash.algorithm === 'blake2b' ? 'blake2b512' : 'sha256');
      for (let at = 0; at < size; at += 1 << 24) hash.update(readAt(fd, at, Math.min(1 << 24, size - at)));
      if (hash.digest('hex') !== f.hash.digest) throw damage.hash(f);
    }
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

module.exports = { Refusal, readDocument, tagDirectory, readAt, openFiles, checkMember };
