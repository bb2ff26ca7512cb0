"""Validate a tensor/pipeline-parallel checkpoint against its index: the index's own rules, then every
domain's files with the 1.x checks (each domain accounts for the files of its model-parallel rank),
then the index's checks of the whole set (``cross_domain/``).

Which index: the one given, else the tag directory's sidecar when it holds an index, else one
generated from DeepSpeed's metadata (``describe/model_parallel.py``).
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from ...checkpoint.sidecar import find_sidecar
from ...checkpoint.states import StateCache
from ...errors import CheckpointInvalid
from ...findings import Finding, finding, has_errors, json_path
from ...format.codec import read_document
from ...format.index_models import CheckpointIndex, Domain
from ...format.index_validate import IndexReport, is_index, validate_index, validate_index_document
from ...location import RemotePath
from ..describe import describe_tag_dir
from ..layout.names import mp_rank_of
from ..layout.parallel_files import index_tag_dir, layer_file_name
from .cross_domain import check_index_files_in_two
from .cross_domain.master_files import check_masters_domain
from .domain import check_checkpoint


def domain_mp_rank(domain: Domain) -> int | None:
    ranks = {mp_rank_of(f.path) for f in domain.manifest.files} - {None}
    return ranks.pop() if len(ranks) == 1 else None


def index_files_bytes(index: CheckpointIndex) -> int:
    """The bytes of the files an index lists (every domain's, the layer and expert files), each once:
    what a remote command's report compares the bytes it fetched with (``checkpoint_bytes``)."""
    sizes = {f.path: f.size for d in index.domains for f in d.manifest.files}
    sizes.update((f.path, f.size) for f in index.layer_files)
    sizes.update((f.path, f.size) for f in index.expert_files or [])
    return sum(sizes.values())


def choose_index(
    tag_dir: Path | RemotePath, index: CheckpointIndex | IndexReport | None, states: StateCache
) -> tuple[CheckpointIndex | None, list[Finding], str]:
    """(index, findings of validating it, where it came from: manifest, sidecar or generated)."""
    if isinstance(index, IndexReport):
        return index.index, list(index.findings), "manifest"
    if index is not None:
        return index, validate_index(index).findings, "manifest"
    sidecar = find_sidecar(tag_dir)
    if sidecar is not None:
        doc, _ = read_document(sidecar)
        if is_index(doc):
            report = validate_index_document(doc)
            found = [f if f.file else dataclasses.replace(f, file=sidecar.name) for f in report.findings]
            return report.index, found, "sidecar"
    try:
        generated = describe_tag_dir(tag_dir, states, as_index=True)
    except CheckpointInvalid as exc:  # files the index is made from are missing: each one's finding
        return None, exc.findings, "generated"
    assert isinstance(generated, CheckpointIndex)  # as_index=True: the index of the directory's kind
    # As for a generated 1.x manifest: the rules run without the file lists (made from the same files,
    # they would only repeat what the file checks say better, naming the file).
    doc = generated.to_dict()
    for dom in doc["domains"]:
        dom["manifest"]["files"], dom["file_ranks"] = [], {}
    return generated, validate_index_document(doc).findings + layer_gaps(generated), "generated"


def layer_gaps(index: CheckpointIndex) -> list[Finding]:
    """CK236 (a warning) for each pipeline layer below the last without a layer file, in an index made
    from the files: DeepSpeed writes one for every torch module (a ReLU's holds no tensor) and its
    load_checkpoint opens each, but a function layer has none, and nothing in the files tells them apart."""
    layers = {lf.layer for lf in index.layer_files}
    return [
        finding(
            "CK236",
            "$.layer_files",
            f"no layer file for pipeline layer {n} (of layers 0 to {max(layers)}): a function layer has none, "
            "but a torch module has one even without parameters",
            f"if layer {n} is a torch module, restore its file: DeepSpeed's load_checkpoint opens it (with an index "
            "recorded at the save, by the save hook or `ckptspec generate -o`, a missing one is an error)",
            severity="warning",
            file=layer_file_name(f"{n}."),
        )
        for n in range(max(layers, default=0))
        if n not in layers
    ]


def validate_index_checkpoint(
    checkpoint: str | os.PathLike | RemotePath,
    index: CheckpointIndex | IndexReport | None = None,
    tag: str | None = None,
    *,
    verify_hashes: bool = True,
    states: StateCache | None = None,
    verify_digests: bool | None = None,
) -> tuple[CheckpointIndex | None, list[Finding]]:
    """Validate a model-parallel checkpoint directory; (index, findings), as ``validate_checkpoint``."""
    tag_dir = index_tag_dir(checkpoint, tag)
    states = states if states is not None else StateCache()
    chosen, findings, source = choose_index(tag_dir, index, states)
    if chosen is None or (has_errors(findings) and source != "generated"):
        return chosen, findings  # a generated index is checked even when its rules fail: the checks say which file
    # The checks across domains run first (their findings come last), but for the hashes of layer and expert
    # files: the few bytes they compare (replicas, samples of the masters) are then fetched before a remote
    # file's hash reads it whole, and taken from memory there, so that each byte is fetched once (docs/remote.md).
    _, across = check_index_files_in_two(chosen, tag_dir, states, verify_hashes=verify_hashes)
    for i, domain in enumerate(chosen.domains):
        if domain.masters is not None:  # #17: masters located in model states, expert or universal files
            findings += check_masters_domain(
                domain, i, tag_dir, states, verify_hashes=verify_hashes, verify_digests=verify_digests
            )
            continue
        mp = domain_mp_rank(domain)
        listed = {f.path for f in domain.manifest.files}

        def scope(rel: str, mp=mp, listed=listed) -> bool:
            return rel in listed or (mp is not None and mp_rank_of(rel) == mp)

        for found in check_checkpoint(
            domain.manifest,
            tag_dir,
            verify_hashes=verify_hashes,
            states=states,
            verify_digests=verify_digests,
            scope=scope,
        ):
            prefix = json_path("domains", i, "manifest")
            findings.append(dataclasses.replace(found, path=prefix + found.path[1:]))
    return chosen, findings + across()
