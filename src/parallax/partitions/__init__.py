"""Partition counts: tables grouped for one searched count, the papers' search and its
in-training tuner, its cache, changing a table's count in place, and the thread pool that
processes a server's partitions in parallel.
"""

from parallax.lazy import submodule_attributes

__getattr__ = submodule_attributes(__name__)
