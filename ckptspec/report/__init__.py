"""Reports on validated manifests: an inspect summary and the diff of two manifests.

Pure computation: ``Manifest`` objects in, JSON-ready dicts out (rendering is the CLI's).
"""
