"""`RowPartitioning`: where each row of a server-held table lives (its owning rank and its row
inside that server's shard), for `parallax.engine.tables.server_table` and
`parallax.engine.tables.pooled`."""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["RowPartitioning"]


class RowPartitioning:
    """Where each row of a ``num_rows``-row table lives: owning rank and row inside its shard."""

    def __init__(self, num_rows: int, num_partitions: int, server_ranks: tuple[int, ...],
                 first_server: int = 0):
        self.num_rows = num_rows
        self.num_partitions = num_partitions
        self.server_ranks = server_ranks
        self.first_server = first_server
        sizes = [max(0, (num_rows - p + num_partitions - 1) // num_partitions)
                 for p in range(num_partitions)]
        owners, offsets = [], []
        self.shard_rows = [0] * len(server_ranks)
        for p, size in enumerate(sizes):
            server = self.server_of_partition(p)
            owners.append(server_ranks[server])
            offsets.append(self.shard_rows[server])
            self.shard_rows[server] += size
        self._sizes = sizes
        self._offsets = offsets
        self._owner_of_partition = torch.tensor(owners, dtype=torch.long)
        self._offset_of_partition = torch.tensor(offsets, dtype=torch.long)
        self._on_device: dict[torch.device, tuple[Tensor, Tensor]] = {}

    @property
    def single_owner(self) -> int | None:
        """The rank holding every row when the table is one partition (else None): a pull
        then sends all its ids to that rank, in the order they already have."""
        if self.num_partitions != 1:
            return None
        return self.server_ranks[self.server_of_partition(0)]

    def server_of_partition(self, partition: int) -> int:
        return (partition + self.first_server) % len(self.server_ranks)

    def owner_rank(self, ids: Tensor) -> Tensor:
        return self._on(ids.device)[0][ids % self.num_partitions]

    def local_row(self, ids: Tensor) -> Tensor:
        offsets = self._on(ids.device)[1]
        return offsets[ids % self.num_partitions] + ids // self.num_partitions

    def _on(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """The owner and offset of each partition on ``device``, copied there once (on a GPU
        each copy from the host would be a transfer and a synchronisation per lookup)."""
        if device not in self._on_device:
            self._on_device[device] = (self._owner_of_partition.to(device),
                                       self._offset_of_partition.to(device))
        return self._on_device[device]

    def shard_blocks(self, server_index: int) -> list[tuple[int, int]]:
        """``(start, stop)`` in one server's shard of each of its partitions, in shard order:
        a partition is a contiguous block of its server's shard."""
        return [(self._offsets[p], self._offsets[p] + self._sizes[p])
                for p in range(self.num_partitions) if self.server_of_partition(p) == server_index]

    def rows_of_server(self, server_index: int) -> Tensor:
        """Global ids held by one server, in the order of its shard."""
        parts = [torch.arange(p, max(p, self.num_rows), self.num_partitions)
                 for p in range(self.num_partitions)
                 if self.server_of_partition(p) == server_index]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long)
