"""`DenseSyncState`: what every dense-synchronisation comm hook is given besides the bucket."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._C._distributed_c10d import GradBucket

from parallax.engine.dense_sync.qsgd_codec import QSGDCodec
from parallax.engine.tables.exchange import Traffic


@dataclass
class DenseSyncState:
    """The hook's state (DDP's ``state`` argument).

    ``traffic`` counts the bytes each parameter moves (c10d reports none); ``names`` maps a
    parameter's ``id`` to its name there; ``world`` ranks sum the bucket; ``average`` divides
    the sum by ``world`` (DDP's mean); ``codec`` and ``generator``: a quantising hook's
    codec and the generator of its random rounding (this rank's own); ``seconds``: time the
    synchronous hooks spent (collectives, encoding and decoding), for `Runner.stats`;
    ``small_sums``: see the field."""

    traffic: Traffic
    names: dict[int, str]
    world: int
    average: bool
    codec: QSGDCodec | None = None
    generator: torch.Generator | None = None
    seconds: float = 0.0
    #: sum the buckets by one all_to_all (`parallax.engine.tables.reduction.small`: the dense
    #: gradients together are small), else ring by ring
    small_sums: bool = False
    #: the coming backward's buckets are left as they are, their sum rides in the push
    #: (`parallax.engine.dense_sync.deferred`); ``deferred``: a hook did leave one
    deferring: bool = False
    deferred: bool = False

    def pieces(self, bucket: GradBucket) -> list[tuple[str, torch.Tensor]]:
        """Each parameter's slice of the bucket's flat buffer, with its name."""
        buffer = bucket.buffer()
        out, offset = [], 0
        for param in bucket.parameters():
            out.append((self.names.get(id(param), "dense"), buffer.narrow(0, offset,
                                                                          param.numel())))
            offset += param.numel()
        return out

    def finish(self, buffer: torch.Tensor) -> torch.Tensor:
        """The summed buffer, averaged when asked."""
        return buffer.div_(self.world) if self.average else buffer
