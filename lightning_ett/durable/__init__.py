"""Writes that survive crashes: atomic small files, manifests with checksums, the one directory commit.

Below every other subsystem: it imports nothing from the package and nothing outside the
standard library.
"""
