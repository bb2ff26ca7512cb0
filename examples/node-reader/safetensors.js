'use strict';
// Write a safetensors file (https://github.com/huggingface/safetensors): an 8-byte little-endian
// header length N, N bytes of JSON header padded with spaces to a multiple of 8, then the tensors'
// bytes back to back. All shapes are known up front, so the header goes first and each tensor is
// written as soon as it is read. The file appears under its name only once complete (rename).
const fs = require('fs');
const path = require('path');
const { Refusal } = require('./files');
const { ITEMSIZE, OUTPUT_DTYPE, SAFETENSORS } = require('./dtypes');

// tensors: [{name, shape, nbytes, out}] in write order (`out`: the written dtype, float32 when
// absent); metadata: {string: string}.
function header(tensors, metadata) {
  const table = { __metadata__: metadata };
  let offset = 0;
  for (const t of tensors) {
    table[t.name] = { dtype: SAFETENSORS[t.out ?? 'float32'], shape: t.shape, data_offsets: [offset, offset + t.nbytes] };
    offset += t.nbytes;
  }
  let json = Buffer.from(JSON.stringify(table), 'utf8');
  json = Buffer.concat([json, Buffer.alloc((8 - (json.length % 8)) % 8, ' ')]);
  const length = Buffer.alloc(8);
  length.writeBigUInt64LE(BigInt(json.length));
  return Buffer.concat([length, json]);
}

function writeAll(fd, bytes) {
  for (let done = 0; done < bytes.length;) done += fs.writeSync(fd, bytes, done, bytes.length - done);
}

// Calls fill(tensor) for each tensor, in order; fill returns that tensor's bytes.
function writeSafetensors(file, tensors, metadata, fill) {
  const tmp = path.join(path.dirname(file), `.${path.basename(file)}.${process.pid}.tmp`);
  const fd = fs.openSync(tmp, 'w');
  try {
    writeAll(fd, header(tensors, metadata));
    for (const t of tensors) {
      const bytes = fill(t);
      if (bytes.length !== t.nbytes) throw new Error(`${t.name}: ${bytes.length} bytes, expected ${t.nbytes}`);
      writeAll(fd, bytes);
    }
    fs.fsyncSync(fd);
    fs.closeSync(fd);
    fs.renameSync(tmp, file);
  } catch (err) {
    try { fs.closeSync(fd); } catch { /* already closed */ }
    fs.rmSync(tmp, { force: true });
    throw err;
  }
}

// A state dict: tensors [{name, shape, dtype, numel, owner?}] in write order, each written in its
// output dtype (floating as float32); read(t) gives a tensor's output bytes, read and checked once
// for an owner, whose aliases (`owner` set) are written as copies of them.
function writeStateDict(file, tensors, metadata, read) {
  for (const t of tensors) {
    t.out = OUTPUT_DTYPE[t.dtype];
    t.nbytes = t.numel * ITEMSIZE[t.out];
  }
  const tied = new Set(tensors.filter((t) => t.owner).map((t) => t.owner));
  const kept = new Map(); // the owners' bytes, copied for their aliases
  try {
    writeSafetensors(file, tensors, metadata, (t) => {
      if (t.owner) return kept.get(t.owner);
      const bytes = read(t);
      if (tied.has(t.name)) kept.set(t.name, bytes);
      return bytes;
    });
  } catch (err) {
    if (err instanceof Refusal) throw err;
    throw new Refusal('CK906', file, `cannot write: ${err.message}`, 'check the output path and free space', 2);
  }
}

module.exports = { writeSafetensors, writeStateDict };
