"""Check: a DeepSpeed checkpoint's files against the document that describes them.

``domain/`` holds the CK2xx checks of one ZeRO domain's files against its 1.x manifest, ``cross_domain/``
those only a checkpoint index's whole file set can tell (CK207, CK23x, CK24x). ``zero.py`` validates a
plain ZeRO checkpoint (choosing its manifest), ``checkpoint_index.py`` one described by a checkpoint
index (``validate_checkpoint`` below chooses between them); ``copies.py`` and ``recorded.py`` read the manifest
copies a checkpoint carries; ``run.py`` lists a training run's tags and checks each.
"""

from __future__ import annotations

import os
from typing import Any

from ...findings import Finding


def validate_checkpoint(
    checkpoint: str | os.PathLike, manifest: Any = None, tag: str | None = None, *, verify_hashes: bool = True
) -> list[Finding]:
    """The findings of a checkpoint of any kind against its document (``ckptspec.validate_checkpoint``: the one
    dispatch on the document, a checkpoint index or a ZeRO manifest). Raises ``CkptspecError`` only when it
    cannot be checked at all."""
    from ..kinds import described_by_index

    if described_by_index(checkpoint, manifest, tag):
        from .checkpoint_index import validate_index_checkpoint

        return validate_index_checkpoint(checkpoint, manifest, tag, verify_hashes=verify_hashes)[1]
    from .zero import validate_checkpoint as validate_zero

    return validate_zero(checkpoint, manifest, tag, verify_hashes=verify_hashes)[1]
