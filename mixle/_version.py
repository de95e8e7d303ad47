"""mixle's version, in a module of its own so that the core can name it without importing the face."""

__version__ = "0.1.0"
