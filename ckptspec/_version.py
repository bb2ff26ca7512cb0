"""The package version, kept apart so that no module needs to import the package root."""

__version__ = "0.1.0.dev0"
