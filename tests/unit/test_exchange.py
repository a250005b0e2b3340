"""One hop of the sparse exchange (`parallax.engine.tables.exchange`): ids made unique, the bytes
counted per peer, the count message and its error flag, payloads of several tables in one
message. Collectives run in a world of one; the per-peer accounting is pure arithmetic."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from parallax.engine.tables.exchange import (
    COUNT_MESSAGE_BYTES,
    INT32_ROWS,
    Hop,
    Traffic,
    exchange_counts,
    read_back,
    sorted_ids_many,
    unique_ids,
    unique_ids_many,
    wire_id_dtype,
)
from parallax.engine.tables.reservations import Reservations, open_carrying
from parallax.errors import SparseIdError

# ---- unique_ids -------------------------------------------------------------------------------


def test_unique_ids_are_sorted_and_inverse_rebuilds_the_ids() -> None:
    """unique_ids: sorted distinct ids, an inverse shaped like the ids, no bad id in range."""
    ids = torch.tensor([[3, 1, 3], [0, 1, 7]])
    unique, inverse, bad = unique_ids(ids, 8, "emb", 0)
    assert unique.tolist() == [0, 1, 3, 7]
    assert inverse.shape == ids.shape
    assert torch.equal(unique[inverse], ids)
    assert bad is None


def test_unique_ids_accept_int32_and_return_int64() -> None:
    """unique_ids: int32 ids are accepted and come back as int64 (index dtype)."""
    unique, inverse, bad = unique_ids(torch.tensor([2, 0, 2], dtype=torch.int32), 3, "emb", 0)
    assert unique.dtype == torch.int64 and unique.tolist() == [0, 2]
    assert inverse.tolist() == [1, 0, 1] and bad is None


@pytest.mark.parametrize(("ids", "bad"), [
    ([4, -3, 2, -1], -3),   # the most negative id
    ([1, 5, 9, 4], 9),      # the largest id past the end (num_rows itself included)
    ([5, 0], 5),
    ([-1, 99], -1),         # both kinds: the negative one
    ([7, 7], 7),            # one distinct id: it is both ends
    ([-2], -2),
])
def test_unique_ids_report_an_id_outside_the_rows(ids: list[int], bad: int) -> None:
    """unique_ids: an id < 0 or >= num_rows is reported (negative first) for Hop.open."""
    assert unique_ids(torch.tensor(ids), 5, "emb", 0)[2] == bad


def test_sorted_ids_keep_every_repeat_and_inverse_places_each_id_once() -> None:
    """sorted_ids_many (Config.id_dedup="servers"): every id in sorted order, the inverse a
    permutation (each looked-up id its own slot), bad ids found as unique_ids finds them."""
    ids = torch.tensor([[3, 1, 3], [0, 1, 7]], dtype=torch.int32)
    [(ordered, inverse, bad)] = sorted_ids_many([ids], [8], ["emb"], 0)
    assert ordered.dtype == torch.int64 and ordered.tolist() == [0, 1, 1, 3, 3, 7]
    assert inverse.shape == ids.shape and sorted(inverse.reshape(-1).tolist()) == list(range(6))
    assert torch.equal(ordered[inverse], ids.long()) and bad is None
    assert sorted_ids_many([torch.tensor([4, 9, 4])], [5], ["emb"], 0)[0][2] == 9


def test_unique_ids_of_no_ids() -> None:
    """unique_ids: an empty lookup gives empty unique ids and no bad id."""
    unique, inverse, bad = unique_ids(torch.empty(0, 3, dtype=torch.long), 5, "emb", 0)
    assert unique.numel() == 0 and inverse.shape == (0, 3) and bad is None


def test_unique_ids_of_several_tables_each_report_their_own_bad_id() -> None:
    """unique_ids_many: each table's unique ids and inverse as unique_ids gives them, and the
    ends read together still name the table (an empty one and one of a single id among them)."""
    ids = [torch.tensor([[3, 1], [3, 0]]), torch.empty(0, dtype=torch.long),
           torch.tensor([6, 2, 9]), torch.tensor([4], dtype=torch.int32), torch.tensor([-1, 2])]
    rows = [4, 5, 8, 5, 3]
    found = unique_ids_many(ids, rows, ["a", "b", "c", "d", "e"], 0)
    assert [bad for _, _, bad in found] == [None, None, 9, None, -1]
    for (unique, inverse, bad), table_ids, n in zip(found, ids, rows, strict=True):
        alone = unique_ids(table_ids, n, "x", 0)
        assert torch.equal(unique, alone[0]) and torch.equal(inverse, alone[1]) and bad == alone[2]
        assert inverse.shape == table_ids.shape
    assert unique_ids_many([], [], [], 0) == []


def test_read_back_of_several_vectors_is_one_list_each() -> None:
    """read_back: each vector's values, in order, for none, one or several vectors (of any
    lengths, empty ones too)."""
    assert read_back([]) == []
    assert read_back([torch.tensor([1, 2])]) == [[1, 2]]
    assert read_back([torch.tensor([1, 2]), torch.tensor([0, 5])]) == [[1, 2], [0, 5]]
    assert read_back([torch.tensor([7]), torch.tensor([], dtype=torch.long),
                      torch.tensor([3, 4, 5])]) == [[7], [], [3, 4, 5]]


def test_float_ids_are_refused_naming_parameter_and_rank() -> None:
    """unique_ids: float ids raise TypeError naming the parameter and rank (no truncation)."""
    with pytest.raises(TypeError, match=r"parameter 'emb' on rank 3: ids must be an integer "
                                        r"tensor, got torch.float32"):
        unique_ids(torch.tensor([1.0, 2.5]), 5, "emb", 3)


# ---- Traffic ----------------------------------------------------------------------------------


def test_traffic_splits_bytes_by_machine_and_skips_self() -> None:
    """Traffic.record: bytes per peer, intra vs inter by machine; self-traffic not counted."""
    traffic = Traffic(rank=1, machine_of_rank=(0, 0, 1, 1))
    traffic.record("emb", [5, 600, 7, 8], [1, 900, 3, 4], 10)
    assert dict(traffic.bytes["emb"]) == {
        "intra_sent": 50, "intra_received": 10,            # peer 0, same machine
        "inter_sent": (7 + 8) * 10, "inter_received": (3 + 4) * 10}
    traffic.record("emb", [1, 0, 0, 0], [0, 0, 0, 2], 3)  # accumulates
    assert traffic.bytes["emb"]["intra_sent"] == 53
    assert traffic.bytes["emb"]["inter_received"] == 76


def test_traffic_per_step_averages_and_reset_clears() -> None:
    """Traffic.per_step: bytes over steps (at least 1), names and keys sorted; reset clears."""
    traffic = Traffic(rank=0, machine_of_rank=(0, 1))
    traffic.record("b", [0, 8], [0, 4], 1)
    traffic.record("a", [0, 2], [0, 6], 1)
    assert traffic.per_step() == {  # steps == 0 counts as one
        "a": {"inter_received": 6.0, "inter_sent": 2.0},
        "b": {"inter_received": 4.0, "inter_sent": 8.0}}
    traffic.steps = 4
    assert traffic.per_step()["b"] == {"inter_received": 1.0, "inter_sent": 2.0}
    assert list(traffic.per_step()) == ["a", "b"]
    traffic.reset()
    assert traffic.steps == 0 and traffic.per_step() == {}


def test_ring_allreduce_bytes_go_to_successor_and_come_from_predecessor() -> None:
    """record_ring_allreduce: 2(W-1)/W of the payload to rank+1, from rank-1; none at W=1."""
    traffic = Traffic(rank=0, machine_of_rank=(0, 0, 1, 1))
    traffic.record_ring_allreduce("d", 1000)
    assert traffic.per_step()["d"] == {"inter_received": 1500.0, "inter_sent": 0.0,
                                       "intra_received": 0.0, "intra_sent": 1500.0}
    alone = Traffic(rank=0, machine_of_rank=(0,))
    alone.record_ring_allreduce("d", 1000)
    assert alone.per_step() == {}


def test_hierarchical_allreduce_bytes_of_leader_and_follower() -> None:
    """Hierarchical AllReduce: followers talk to their leader; leaders also ring the leaders."""
    machines = (0, 0, 1, 1, 2, 2)
    follower = Traffic(rank=3, machine_of_rank=machines)
    follower.record_hierarchical_allreduce("d", 300, leader=2, num_machines=3)
    assert follower.per_step()["d"] == {"inter_received": 0.0, "inter_sent": 0.0,
                                        "intra_received": 300.0, "intra_sent": 300.0}
    leader = Traffic(rank=2, machine_of_rank=machines)
    leader.record_hierarchical_allreduce("d", 300, leader=2, num_machines=3)
    assert leader.per_step()["d"] == {"inter_received": 400.0, "inter_sent": 400.0,
                                      "intra_received": 300.0, "intra_sent": 300.0}
    assert leader.bytes["d"]["inter_sent"] == 2 * 2 * 300 // 3  # to leader 4; from leader 0


# ---- Hop --------------------------------------------------------------------------------------


def test_count_message_is_three_int64() -> None:
    """The count message of a hop carries count, error flag and bad id: 24 bytes per peer."""
    assert COUNT_MESSAGE_BYTES == 3 * torch.empty(0, dtype=torch.int64).element_size()


def test_hop_round_trip_in_a_world_of_one(group: dist.ProcessGroup) -> None:
    """Hop.open learns the receive counts; forward and backward return the payload intact."""
    traffic = Traffic(0, (0,))
    hop = Hop.open([3], group=group, traffic=traffic, name="emb", num_rows=10)
    assert hop.send_counts == {"emb": [3]} and hop.recv_counts == {"emb": [3]}
    rows = torch.arange(6, dtype=torch.float64).view(3, 2)
    assert torch.equal(hop.forward(rows), rows)
    assert torch.equal(hop.backward(rows * 2), rows * 2)
    assert traffic.per_step() == {}  # all of it self-traffic


def test_counts_of_a_one_rank_group_stay_on_the_host(group: dist.ProcessGroup) -> None:
    """exchange_counts in a world of one returns the host message itself: no trip through the
    device (on a GPU two copies and a synchronisation per hop; here a `meta` device, which
    a trip would leave unreadable), and Hop.open with a device opens on the host's counts."""
    message = torch.tensor([[[4, 0, 0]]])
    assert exchange_counts(message, group=group, device=torch.device("meta")) is message
    hop = Hop.open([4], group=group, traffic=Traffic(0, (0,)), name="emb", num_rows=10,
                   device=torch.device("meta"))
    assert hop.recv_counts == {"emb": [4]}


def test_a_one_rank_group_opens_its_carrying_hop_on_the_counts_it_sent(
        group: dist.ProcessGroup) -> None:
    """open_carrying in a world of one reads no header back from the device (a `meta` device
    here, which has no values to read) and still refuses a bad id."""
    meta = torch.device("meta")
    rooms = {"a": Reservations(1), "b": Reservations(1)}
    hop, ids = open_carrying({"a": torch.empty(3, dtype=torch.long, device=meta),
                              "b": torch.empty(0, dtype=torch.long, device=meta)},
                             {"a": [3], "b": [0]}, reservations=rooms, group=group,
                             traffic=Traffic(0, (0,)), num_rows={"a": 9, "b": 4},
                             bad_ids={"a": None, "b": None})
    assert hop.recv_counts == {"a": [3], "b": [0]}
    assert ids["a"].device == meta and ids["a"].shape == (3,)
    with pytest.raises(SparseIdError, match="'b' got id 7 on rank 0"):
        open_carrying({"a": torch.empty(1, dtype=torch.long, device=meta),
                       "b": torch.empty(1, dtype=torch.long, device=meta)},
                      {"a": [1], "b": [1]}, reservations=rooms, group=group,
                      traffic=Traffic(0, (0,)), num_rows={"a": 9, "b": 4},
                      bad_ids={"a": None, "b": 7})


def test_hop_carries_tables_of_different_dtype_and_shape_in_one_message(
        group: dist.ProcessGroup) -> None:
    """forward_many/backward_many return each table's payload byte-exact, dtype and shape kept."""
    hop = Hop.open_many({"a": [3], "b": [2], "c": [0]}, group=group, traffic=Traffic(0, (0,)),
                        num_rows={"a": 5, "b": 5, "c": 5})
    payloads = {"a": torch.randn(3, 2, 4, dtype=torch.float64),
                "b": torch.tensor([7, -2], dtype=torch.int64),
                "c": torch.empty(0, 3, dtype=torch.float32)}
    for sent in (hop.forward_many(payloads), hop.backward_many(payloads)):
        assert set(sent) == {"a", "b", "c"}
        for name, payload in payloads.items():
            assert sent[name].dtype == payload.dtype and sent[name].shape == payload.shape
            assert torch.equal(sent[name], payload)


def test_bad_id_fails_the_hop_naming_parameter_id_rank_and_rows(
        group: dist.ProcessGroup) -> None:
    """The count message's error flag makes Hop.open raise SparseIdError naming id, rank, rows."""
    with pytest.raises(SparseIdError, match=r"^parallax: sparse parameter 'emb' got id -3 on "
                                            r"rank 0 \(machine 0\), outside its rows \[0, 10\)$"):
        Hop.open([2], group=group, traffic=Traffic(0, (0,)), name="emb", num_rows=10,
                 bad_id=-3)


def test_bad_id_zero_is_reported_too(group: dist.ProcessGroup) -> None:
    """The error flag, not the id's value, marks a failure: a bad id of 0 still raises."""
    with pytest.raises(SparseIdError, match=r"got id 0 on rank 0"):
        Hop.open([1], group=group, traffic=Traffic(0, (0,)), name="empty", num_rows=0,
                 bad_id=0)


def test_bad_id_of_one_table_among_several_names_that_table(group: dist.ProcessGroup) -> None:
    """Hop.open_many: the table with the bad id is the one named, with its own row count."""
    with pytest.raises(SparseIdError, match=r"'second' got id 12 .* \[0, 12\)"):
        Hop.open_many({"first": [1], "second": [1]}, group=group, traffic=Traffic(0, (0,)),
                      num_rows={"first": 4, "second": 12}, bad_ids={"first": None, "second": 12})


# ---- ids on the wire --------------------------------------------------------------------------


def test_ids_travel_as_int32_only_where_every_table_fits() -> None:
    assert wire_id_dtype([10, INT32_ROWS]) == torch.int32
    assert wire_id_dtype([10, INT32_ROWS + 1]) == torch.int64


def _open_carrying(group: dist.ProcessGroup, ids: dict[str, list[int]], num_rows: dict[str, int],
                   bad_ids: dict[str, int | None], traffic: Traffic,
                   ) -> tuple[Hop, dict[str, torch.Tensor]]:
    return open_carrying({n: torch.tensor(v, dtype=torch.int64) for n, v in ids.items()},
                         {n: [len(v)] for n, v in ids.items()},
                         reservations={n: Reservations(1) for n in ids}, group=group,
                         traffic=traffic, num_rows=num_rows, bad_ids=bad_ids)


def test_ids_sent_as_int32_arrive_as_the_same_int64_ids(group: dist.ProcessGroup) -> None:
    """A message of int32 ids (the header viewed in that dtype) gives back every table's ids,
    int64, with the exact counts; a table too large for int32 makes the message int64."""
    for rows, ids in ((1000, [3, 999, 0]), (INT32_ROWS + 5, [INT32_ROWS + 4, 7])):
        for _ in range(3):  # the first opening overflows its empty rooms; later ones fit
            hop, received = _open_carrying(group, {"a": ids, "b": [1, 2]},
                                           {"a": rows, "b": 4}, {}, Traffic(0, (0,)))
            assert hop.recv_counts == {"a": [len(ids)], "b": [2]}
            assert received["a"].dtype == torch.int64 and received["a"].tolist() == ids
            assert received["b"].tolist() == [1, 2]


def test_a_bad_id_beyond_int32_is_named_exactly(group: dist.ProcessGroup) -> None:
    """The bad id travels in the int64 header, not among the int32 ids it would wrap in."""
    with pytest.raises(SparseIdError, match=rf"got id {2**40} on rank 0 .* \[0, 10\)"):
        _open_carrying(group, {"emb": [1, 2**40]}, {"emb": 10}, {"emb": 2**40},
                       Traffic(0, (0,)))
