"""`DenseSyncState`: what every dense-synchronisation comm hook is given besides the bucket."""

from __future__ import annotations

from dataclasses import dataclass, field

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

    #: per bucket (its index and parameters): each parameter's name and bytes (`payloads`)
    _payloads: dict[tuple[int, ...], list[tuple[str, int]]] = field(
        default_factory=dict, init=False, repr=False)

    def payloads(self, bucket: GradBucket) -> list[tuple[str, int]]:
        """Each parameter's name and bytes in the bucket's flat buffer: the same every step
        for the same bucket, so worked out once per bucket (every backward asks, and a slice
        of the buffer per parameter costs operators as well as calls)."""
        params = bucket.parameters()
        key = (bucket.index(), *map(id, params))
        known = self._payloads.get(key)
        if known is None:
            size = bucket.buffer().element_size()
            known = self._payloads[key] = [(self.names.get(id(param), "dense"),
                                            param.numel() * size) for param in params]
        return known

    def finish(self, buffer: torch.Tensor) -> torch.Tensor:
        """The summed buffer, averaged when asked."""
        return buffer.div_(self.world) if self.average else buffer
