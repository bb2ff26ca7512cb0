"""Bytes of checkpoint files: torch zip files read without torch, their decoded states (read
once), content hashes, and the manifest copies a file carries.

Knows torch's file format but not DeepSpeed's file names; never imports torch or numpy.
"""
