#!/usr/bin/env node
'use strict';
// Validate many JSON manifests and checkpoint indexes in one process; print one JSON object per file on stdout:
//   {"file", "raw_valid", "raw_errors", "codes", "warnings"}
// raw_*: the JSON Schema of the document's kind and version alone (ajv), nothing else. codes/warnings: the full check
// of check.js, or of index-check.js for an index, or of dcp.js for a DCP document (version gate, schema, semantic rules),
// as `ckptspec validate` reports them.
// Usage: node validate.js [--schema FILE] DOCUMENT.json...   (exit 0 all valid, 1 some invalid, 2 usage)
// --schema FILE checks manifests against FILE instead of the shipped manifest schemas.
const fs = require('fs');
const { compileSchemas, schemaFor, checkManifest } = require('./check');
const { compileIndexSchema, checkIndex, isIndex } = require('./index-check');
const { compileDcpSchema, checkDcp, isDcp } = require('./dcp');

function main(argv) {
  let schemaFile = null; // default: each document's own version's schema
  if (argv[0] === '--schema') { schemaFile = argv[1]; argv = argv.slice(2); }
  if (!argv.length) {
    process.stderr.write('usage: node validate.js [--schema FILE] DOCUMENT.json...\n');
    return 2;
  }
  const warnings = [];
  let validators;
  let indexValidator;
  let dcpValidator;
  try {
    validators = compileSchemas(schemaFile, warnings);
    indexValidator = compileIndexSchema(undefined, warnings);
    dcpValidator = compileDcpSchema(warnings);
  } catch (err) { // strict mode refuses unknown keywords and formats, ambiguous types...
    process.stderr.write(`${schemaFile ?? 'schema/'}: ajv cannot compile the schema: ${err.message}\n`);
    return 2;
  }
  for (const w of warnings) process.stderr.write(`${schemaFile ?? 'schema/'}: ajv warning: ${w}\n`);
  let status = 0;
  for (const file of argv) {
    let doc;
    try {
      doc = JSON.parse(fs.readFileSync(file, 'utf8'));
    } catch (err) {
      process.stdout.write(JSON.stringify({ file, error: err.message }) + '\n');
      status = 2;
      continue;
    }
    const index = isIndex(doc);
    const dcp = isDcp(doc);
    const validate = dcp ? dcpValidator : index ? indexValidator : schemaFor(validators, doc);
    const raw = validate(doc);
    const findings = dcp ? checkDcp(dcpValidator, doc)
      : index ? checkIndex(indexValidator, validators, doc) : checkManifest(validators, doc);
    const codes = (severity) => [...new Set(findings.filter((f) => f.severity === severity).map((f) => f.code))].sort();
    const verdict = {
      file,
      raw_valid: raw,
      raw_errors: raw ? [] : validate.errors.map((e) => ({ path: e.instancePath, keyword: e.keyword, message: e.message })),
      codes: codes('error'),
      warnings: codes('warning'),
    };
    if (verdict.codes.length) status = Math.max(status, 1);
    process.stdout.write(JSON.stringify(verdict) + '\n');
  }
  return status;
}

process.exitCode = main(process.argv.slice(2));
