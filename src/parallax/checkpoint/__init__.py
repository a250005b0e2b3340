"""Checkpoints: sharded save/load on any cluster shape, atomic files with checksums and
manifests, and export to a plain single-device state_dict.
"""
