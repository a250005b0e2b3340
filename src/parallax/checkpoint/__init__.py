"""Checkpoints: sharded save/load on any cluster shape, atomic files with checksums and
manifests, export to a plain single-device state_dict, and the running job's single-device
view (`single_device`: state dicts out and in).

Why our own format rather than ``torch.distributed.checkpoint`` (DCP): DCP reshards a tensor
by the offsets of contiguous chunks, but a server's shard is the union of its partitions, and a
partition is the rows ``id % P == p`` (strided, so Zipf-hot small ids spread over servers), and
``P`` itself changes in training (the partition search, `Runner.repartition`). We store each
shard's rows with their *global ids* instead, which loads on any shape and partition count;
DCP also neither checksums nor fsyncs, and we keep both (`files`). DCP is the exchange format at
the edges (`dcp`: `export_dcp` out, `load_dcp` in). The DTensor shards of model parallelism are
contiguous: there DCP fits, and `save_dcp` writes them through it, each rank its own.
"""

from parallax.checkpoint.dcp import export_dcp, load_dcp, save_dcp
from parallax.lazy import submodule_attributes

__all__ = ["export_dcp", "load_dcp", "save_dcp"]

# submodules not imported above, as attributes on first use
__getattr__ = submodule_attributes(__name__)
