"""The package's version, in a module of its own: reading it imports nothing else of the package."""

__version__ = "0.1.0"
