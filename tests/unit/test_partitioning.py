"""Row partitioning of sparse tables: every row has exactly one home, and the pieces agree."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from parallax.engine.tables.server_table import RowPartitioning


@given(num_rows=st.integers(0, 300), num_partitions=st.integers(1, 12),
       num_servers=st.integers(1, 5))
def test_every_row_lives_in_exactly_one_shard_slot(num_rows: int, num_partitions: int,
                                                   num_servers: int) -> None:
    server_ranks = tuple(range(0, 2 * num_servers, 2))  # first worker of each 2-worker machine
    parts = RowPartitioning(num_rows, num_partitions, server_ranks)
    ids = torch.arange(num_rows)
    owner = parts.owner_rank(ids)
    local = parts.local_row(ids)
    assert sum(parts.shard_rows) == num_rows
    for index, rank in enumerate(server_ranks):
        held = parts.rows_of_server(index)
        mine = ids[owner == rank]
        # The shard's order is exactly what local_row addresses, with no gap and no overlap.
        assert sorted(held.tolist()) == mine.tolist()
        assert torch.equal(local[held], torch.arange(parts.shard_rows[index]))
        # Partition p = id % P lives on server p % S: hot small ids spread over all servers.
        assert all((i % num_partitions) % num_servers == index for i in held.tolist())


def test_partitions_spread_consecutive_ids_over_servers() -> None:
    parts = RowPartitioning(10, 4, (0, 2))
    assert parts.owner_rank(torch.arange(8)).tolist() == [0, 2, 0, 2, 0, 2, 0, 2]
    assert parts.shard_rows == [5, 5]
