'use strict';
// Element sizes (docs/spec.md#dtypes) and the widening of master partitions to float32.
// Every shard is little-endian (the torch zip's `byteorder` record; spec.md#locators).

const ITEMSIZE = {
  float64: 8, float32: 4, float16: 2, bfloat16: 2, float8_e4m3fn: 1, float8_e5m2: 1,
  int64: 8, int32: 4, int16: 2, int8: 1, uint8: 1, bool: 1, complex64: 8, complex128: 16,
};

// The master dtypes this reader can widen exactly to float32.
const WIDENABLE = new Set(['float32', 'float16', 'bfloat16']);

// The dtype each stored dtype is written as (as `ckptspec reconstruct` writes the default fp32):
// floating tensors as float32, integer and bool tensors as they are.
const OUTPUT_DTYPE = {
  float32: 'float32', float16: 'float32', bfloat16: 'float32',
  int64: 'int64', int32: 'int32', int16: 'int16', int8: 'int8', uint8: 'uint8', bool: 'bool',
};

// safetensors dtype codes of the output dtypes.
const SAFETENSORS = { float32: 'F32', int64: 'I64', int32: 'I32', int16: 'I16', int8: 'I8', uint8: 'U8', bool: 'BOOL' };

// bfloat16 is the top half of a float32: widening is a 16-bit shift.
function bf16ToF32Bits(h) {
  return (h << 16) >>> 0;
}

// IEEE binary16 -> binary32, exact. NaN payloads are kept (as numpy's astype does).
function f16ToF32Bits(h) {
  const sign = (h & 0x8000) << 16;
  const exp = (h >> 10) & 0x1f;
  let frac = h & 0x3ff;
  if (exp === 0x1f) return (sign | 0x7f800000 | (frac << 13)) >>> 0; // inf, NaN
  if (exp !== 0) return (sign | ((exp + 112) << 23) | (frac << 13)) >>> 0; // normal: rebias 15 -> 127
  if (frac === 0) return sign >>> 0; // +-0
  // Subnormal half (frac * 2^-24) is a normal float32: shift the leading 1 into place.
  let e = 113;
  while (!(frac & 0x400)) { frac <<= 1; e -= 1; }
  return (sign | (e << 23) | ((frac & 0x3ff) << 13)) >>> 0;
}

// Little-endian bytes of `dtype` -> little-endian float32 bytes.
function toFloat32(bytes, dtype) {
  if (dtype === 'float32') return bytes;
  const widen = dtype === 'bfloat16' ? bf16ToF32Bits : dtype === 'float16' ? f16ToF32Bits : null;
  if (!widen) throw new Error(`cannot widen ${dtype} to float32`);
  const out = Buffer.alloc(bytes.length * 2);
  for (let i = 0; i < bytes.length / 2; i++) out.writeUInt32LE(widen(bytes.readUInt16LE(2 * i)), 4 * i);
  return out;
}

module.exports = { ITEMSIZE, WIDENABLE, OUTPUT_DTYPE, SAFETENSORS, toFloat32 };
