"""The manifest format this package reads and writes.

Kept apart from ``models`` (which imports pydantic) so that ``ckptspec validate``
can gate on the version without paying for the models it may not build.
"""

FORMAT_NAME = "ckptspec.manifest"
FORMAT_VERSION = "1.0.0"
