"""Semantic rules: what the JSON Schema cannot say about a manifest.

One rule = one function = one stable code. Each rule yields every finding it
sees (not just the first) and assumes the document already passed the schema.
``docs/errors.md`` documents each code; ``tests/conformance`` has a fixture for each.

Rules read the plain JSON document (dicts and lists, as decoded), not the Pydantic
models: that is what another implementation sees, and it lets ``ckptspec validate``
check a million-parameter manifest without building a million model objects.
Integers must be ``int`` (the loader turns an integral ``3.0`` into ``3``), and JSON
paths are only rendered for findings, never for every parameter.
"""

from __future__ import annotations

from ...findings import Finding, RuleSet
from . import aliases, files, groups, locators, optimizer, tensors
from .document import Document, RuleFn

# The order the rules run in, and so the order of their findings.
RULES: RuleSet[RuleFn] = RuleSet(
    tensors.RULES, aliases.RULES, groups.RULES, files.RULES, locators.RULES, optimizer.RULES
)


def check_document(doc: Document) -> list[Finding]:
    """Run every semantic rule on a schema-valid document; findings in rule order."""
    return [found for rule in RULES for found in rule.check(doc)]


__all__ = ["RULES", "check_document"]
