#!/usr/bin/env node
'use strict';
// Rebuild the full state dict of a DeepSpeed ZeRO checkpoint from its ckptspec manifest, in plain
// Node.js: no torch, no pickle, no zip parsing. The manifest's locators (docs/spec.md#locators)
// give the byte offset of every rank's flat master partition inside the .pt files, and (format
// 1.1, docs/spec.md#tensor-locators) of every frozen parameter and buffer. Given a checkpoint index
// (docs/spec-checkpoint.md: tensor/pipeline parallel, MoE, stage 0, universal folders), the whole
// model composed from every domain's tensors (compose.js). Given a torch DCP document (docs/spec-dcp.md),
// every tensor of the saved state dict from its chunks' elements, in its saved dtype (dcp.js).
//
//   node reader.js [--no-hash] MANIFEST.json CHECKPOINT OUT.safetensors
//
// MANIFEST.json is a manifest, a checkpoint index or a DCP document (told apart by `format`). CHECKPOINT is the
// directory the document's file paths are relative to (the tag directory), or the save directory
// above it, whose `latest` file names the tag. Exit status: 0 written, 1 invalid document or
// checkpoint files, 2 usage or I/O error. Nothing is written unless all is well.
// Every key is written (tied aliases as copies of their owner); floating tensors as float32.
const fs = require('fs');
const { compileSchemas, checkManifest } = require('./check');
const { compileIndexSchema, checkIndex, isIndex } = require('./index-check');
const { reconstructIndex } = require('./compose');
const { Refusal, readDocument, tagDirectory, openFiles } = require('./files');
const { refuseUnreadable, planManifest, addAliases, readTensor } = require('./plan');
const { writeStateDict } = require('./safetensors');
const { isDcp, compileDcpSchema, checkDcp, reconstructDcp } = require('./dcp');

const USAGE = 'usage: node reader.js [--no-hash] MANIFEST.json CHECKPOINT OUT.safetensors';

function reconstruct(manifest, dir, out, checkHash) {
  const { layout } = manifest;
  if (layout.tensor_parallel_size !== 1 || layout.pipeline_parallel_size !== 1) {
    throw new Refusal('CK402', '$.layout', 'the manifest describes one model-parallel rank, not the whole model',
      'this reader handles data parallelism only');
  }
  refuseUnreadable(manifest);
  const fds = openFiles(manifest.files, dir, checkHash);
  const { trainable, others, absent } = planManifest(manifest, fds);
  const tensors = [...trainable, ...others];
  const aliases = addAliases(tensors, manifest.aliases, absent);
  const metadata = {
    format: 'pt',
    'ckptspec.format_version': manifest.format_version,
    'ckptspec.dtype': 'float32',
    'ckptspec.aliases': JSON.stringify(aliases),
    'ckptspec.untied': 'true',
    'ckptspec.absent': JSON.stringify(absent),
  };
  writeStateDict(out, tensors, metadata, readTensor);
  return { tensors: tensors.length, aliases: Object.keys(aliases).length, absent: Object.keys(absent) };
}

// The document's findings on stderr; whether it may be read (no error).
function checked(file, doc) {
  const manifests = compileSchemas(null, [], true); // lazy: only the schemas of the versions the document has
  const findings = isDcp(doc) ? checkDcp(compileDcpSchema(), doc)
    : isIndex(doc) ? checkIndex(compileIndexSchema(null, [], true), manifests, doc)
      : checkManifest(manifests, doc);
  for (const f of findings) {
    const label = f.severity === 'error' ? f.code : `${f.code} warning:`;
    process.stderr.write(`${file}: ${f.where}: ${label} ${f.message} (hint: ${f.hint})\n`);
  }
  return !findings.some((f) => f.severity === 'error');
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
    const doc = readDocument(manifestFile);
    if (!checked(manifestFile, doc)) return 1;
    if (!fs.statSync(checkpoint, { throwIfNoEntry: false })?.isDirectory()) {
      throw new Refusal('CK901', checkpoint, 'is not a directory', 'pass the checkpoint (save or tag) directory', 2);
    }
    const done = isDcp(doc) ? reconstructDcp(doc, checkpoint, out, checkHash)
      : (isIndex(doc) ? reconstructIndex : reconstruct)(doc, tagDirectory(checkpoint), out, checkHash);
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
