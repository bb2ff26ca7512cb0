"""Write the msgpack members of the conformance corpus from their JSON siblings.

    python tests/conformance/make_msgpack.py          # (re)write the .msgpack files
    python tests/conformance/make_msgpack.py --check  # exit 1 if a committed file differs

Each ``X.msgpack`` is ``X.json`` decoded with the standard ``json`` module and packed
with ``msgpack.packb(doc, use_bin_type=True)``: strings as msgpack str, integers in the
smallest msgpack int type (2**63 becomes a uint64), floats as float64. Map order
follows the JSON file, so the bytes are reproducible. Its verdict in ``expected.json``
is the sibling's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import msgpack

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "1.0"
SIBLINGS = [
    "1.0/valid/stage3-per-param-two-subgroups-ws3.json",
    "1.0/invalid/CK001-schema-numel-above-int64.json",
    "1.0/invalid/CK117-locator-numel-mismatch.json",
    # format 1.1 (their expected.json entries are written by make_corpus.py, MSGPACK_1_1)
    "1.1/valid/stage3-fragments-subgroups-ws3.json",
    "1.1/invalid/CK125-state-numel-is-saved-numel.json",
]


def packed(json_path: Path) -> bytes:
    return msgpack.packb(json.loads(json_path.read_text("utf-8")), use_bin_type=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="only compare with the committed files")
    args = parser.parse_args(argv)
    stale = []
    for sibling in SIBLINGS:
        source = HERE / sibling
        target = source.with_suffix(".msgpack")
        data = packed(source)
        if target.exists() and target.read_bytes() == data:
            continue
        stale.append(target.relative_to(HERE).as_posix())
        if not args.check:
            target.write_bytes(data)
    if args.check and stale:
        print("out of date: " + ", ".join(stale), file=sys.stderr)
        return 1
    if not args.check:
        print(f"wrote {len(stale)} file(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
