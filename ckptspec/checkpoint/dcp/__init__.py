"""Torch Distributed Checkpoint (DCP) directories as an input: ``.metadata`` read without running it (issue #42)."""
