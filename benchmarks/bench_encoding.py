"""JSON vs msgpack for a large manifest: size, decode time, decode + validate time.

    .venv/bin/python benchmarks/bench_encoding.py            # 100k parameters (about a minute)
    .venv/bin/python benchmarks/bench_encoding.py --params 10000 --repeat 3

The manifest is synthetic but valid: a ZeRO-2 layout of ``--params`` parameters in
two flat groups over 8 ranks (with frozen parameters, buffers, aliases and one
optimizer-states file per rank with its locators). Each encoding is its canonical
form (``ckptspec.format.codec.dumps``); "decode" is reading the bytes with the
validator's own loader (``ckptspec.format.codec.decode``: UTF-8, duplicate-key and NaN
checks included), "+ validate" adds ``ckptspec.validate_document`` (schema, models,
semantic rules). Times are CPU seconds of this process (``time.process_time``: steadier
than wall time on a shared machine), the median of ``--repeat`` runs, printed as a
markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from synthetic import WORLD, synthetic_manifest

from ckptspec.format.codec import (
    decode,
    dumps,
)
from ckptspec.format.validate import validate_document


def _median_seconds(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return statistics.median(times)


def measure(n_params: int, repeat: int, validate: bool = True) -> list[dict]:
    doc = synthetic_manifest(n_params).to_dict()
    rows = []
    for encoding in ("json", "msgpack"):
        data = dumps(doc, encoding)
        assert decode(data, encoding) == doc
        row = {
            "encoding": encoding,
            "bytes": len(data),
            "decode_s": _median_seconds(lambda data=data, encoding=encoding: decode(data, encoding), repeat),
        }
        if validate:

            def load_and_validate(data=data, encoding=encoding):
                report = validate_document(decode(data, encoding))
                assert report.ok, [f.to_line() for f in report.findings][:3]

            row["decode_validate_s"] = _median_seconds(load_and_validate, repeat)
        rows.append(row)
    return rows


def markdown(rows: list[dict], n_params: int) -> str:
    json_row = rows[0]
    lines = [
        f"Manifest with {n_params:,} parameters ({WORLD} ranks, ZeRO-2), median CPU seconds of the runs:",
        "",
        "| encoding | size (bytes) | size vs JSON | decode (s) | decode vs JSON | decode + validate (s) | vs JSON |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        validate = row.get("decode_validate_s")
        lines.append(
            f"| {row['encoding']} | {row['bytes']:,} | {row['bytes'] / json_row['bytes']:.2f} | "
            f"{row['decode_s']:.3f} | "
            f"{row['decode_s'] / json_row['decode_s']:.2f} | "
            + (f"{validate:.3f} | {validate / json_row['decode_validate_s']:.2f} |" if validate else "- | - |")
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--no-validate", action="store_true", help="measure decoding only")
    args = parser.parse_args(argv)
    rows = measure(args.params, args.repeat, validate=not args.no_validate)
    print(markdown(rows, args.params))
    return 0


if __name__ == "__main__":
    sys.exit(main())
