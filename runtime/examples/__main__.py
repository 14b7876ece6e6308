"""Regenerate the shipped example files."""

from . import write_examples

write_examples()
