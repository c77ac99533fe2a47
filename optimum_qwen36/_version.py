"""The package version, which compiled artifacts and the compile cache record."""

__version__ = "0.1.0"
