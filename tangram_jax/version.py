"""The package's version: a leaf module, read by the package root and by what records where a
result came from (profiles' creation metadata), so neither imports the other for it."""

__version__ = "0.1.0"
