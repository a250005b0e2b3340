"""Resource files, the rank layout and the current worker's identity."""

import os
import socket

import pytest
import torch

from parallax.cluster import (
    RESOURCES_ENV,
    EnvironmentPatch,
    Machine,
    ResourceError,
    ResourceSpec,
    WorkerInfo,
    current_worker,
    local_spec,
    parse_resource_text,
    parse_resources,
)

LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", RESOURCES_ENV)


def test_parse_comments_blank_lines_and_devices(tmp_path):
    path = tmp_path / "resources.txt"
    path.write_text(
        "# an emulated cluster\n"
        "\n"
        "localhost:0,1   # first machine\n"
        "  localhost: 2 , 3\n"
        "node-b.example.com\n"
        "[::1]:4\n"
    )
    spec = parse_resources(path)
    assert spec.machines == (
        Machine("localhost", (0, 1)),
        Machine("localhost", (2, 3)),
        Machine("node-b.example.com", ()),
        Machine("::1", (4,)),
    )
    assert [m.num_workers for m in spec.machines] == [2, 2, 1, 1]
    assert spec.world_size == 6


def test_same_host_twice_is_two_machines_ranks_machine_by_machine():
    spec = parse_resource_text("localhost:0,1,2\nlocalhost\nlocalhost:0,1\n")
    assert len(spec.machines) == 3
    assert spec.machine_of_rank == (0, 0, 0, 1, 2, 2)
    assert [spec.first_rank(m) for m in range(3)] == [0, 3, 4]
    assert [spec.device_of_rank(r) for r in range(6)] == [0, 1, 2, None, 0, 1]
    with pytest.raises(ResourceError, match="machine 3 out of range 0..2"):
        spec.first_rank(3)


@pytest.mark.parametrize(
    ("text", "line", "reason"),
    [
        ("localhost\nbad host!:0\n", 2, "bad host"),
        ("localhost:0,,1\n", 1, "empty device"),
        ("# c\nlocalhost:\n", 2, "empty device"),
        ("localhost:0,x\n", 1, "not a non-negative integer"),
        ("localhost:-1\n", 1, "not a non-negative integer"),
        ("localhost:0,1\n\nlocalhost:1,1  # dup\n", 3, "duplicate device 1"),
        (":0\n", 1, "missing host"),
        ("[not-v6]:0\n", 1, "bad host"),
    ],
)
def test_errors_name_file_line_reason_and_line(tmp_path, text, line, reason):
    path = tmp_path / "res.txt"
    path.write_text(text)
    with pytest.raises(ResourceError) as info:
        parse_resources(path)
    message = str(info.value)
    offending = text.splitlines()[line - 1].strip()
    assert message.startswith(f"{path}:{line}: ")
    assert reason in message
    assert message.endswith(f": {offending}")
    assert isinstance(info.value, ValueError)


@pytest.mark.parametrize("text", ["", "\n  \n", "# only comments\n# here\n"])
def test_empty_file_is_an_error(text):
    with pytest.raises(ResourceError, match=r"^res\.txt:1: empty resource file"):
        parse_resource_text(text, source="res.txt")


def test_local_spec():
    spec = local_spec(2, 3)
    assert spec.machines == (Machine("localhost", (0, 1, 2)),) * 2
    assert spec.world_size == 6
    assert spec.machine_of_rank == (0, 0, 0, 1, 1, 1)
    assert spec.is_local()
    with pytest.raises(ValueError):
        local_spec(0, 1)


def test_is_local():
    for host in ("localhost", "127.0.0.1", "127.0.1.1", "::1", socket.gethostname()):
        assert ResourceSpec((Machine(host),)).is_local(), host
    assert not parse_resource_text("localhost\nremote-gpu-node-42\n").is_local()


def test_json_round_trip():
    spec = parse_resource_text("localhost:0,1\nhost-b\n[::1]:3\n")
    assert ResourceSpec.from_json(spec.to_json()) == spec
    with pytest.raises(ValueError):
        ResourceSpec(())


def _set_env(monkeypatch, **values):
    for key in LAUNCH_ENV:
        monkeypatch.delenv(key, raising=False)
    for key, value in values.items():
        monkeypatch.setenv(key, str(value))


def test_current_worker_outside_a_launch(monkeypatch):
    _set_env(monkeypatch)
    assert current_worker() is None
    _set_env(monkeypatch, RANK=0)
    assert current_worker() is None


def test_current_worker_from_our_spec(monkeypatch):
    # unequal machines: only the spec knows the layout (torch's LOCAL_RANK is ignored)
    spec = parse_resource_text("localhost:0,1\nlocalhost\nlocalhost:5,6,7\n")
    _set_env(
        monkeypatch,
        RANK=4,
        WORLD_SIZE=6,
        LOCAL_RANK=4,
        LOCAL_WORLD_SIZE=6,
        GROUP_RANK=0,
        **{RESOURCES_ENV: spec.to_json()},
    )
    worker = current_worker()
    assert worker == WorkerInfo(
        rank=4,
        world_size=6,
        local_rank=1,
        machine=2,
        num_machines=3,
        machine_of_rank=(0, 0, 1, 2, 2, 2),
        device_index=6,
    )
    assert worker.server_ranks == (0, 2, 3)
    assert not worker.is_server

    monkeypatch.setenv("RANK", "2")
    assert current_worker().is_server

    monkeypatch.setenv("WORLD_SIZE", "5")
    with pytest.raises(ResourceError, match="WORLD_SIZE=5"):
        current_worker()


def test_current_worker_under_plain_torchrun(monkeypatch):
    _set_env(monkeypatch, RANK=5, WORLD_SIZE=8, LOCAL_RANK=1, LOCAL_WORLD_SIZE=4, GROUP_RANK=1)
    worker = current_worker()
    assert (worker.rank, worker.world_size, worker.local_rank) == (5, 8, 1)
    assert (worker.machine, worker.num_machines) == (1, 2)
    assert worker.machine_of_rank == (0, 0, 0, 0, 1, 1, 1, 1)
    assert worker.server_ranks == (0, 4)
    assert not worker.is_server
    assert worker.device == torch.device("cpu")


def test_device(monkeypatch):
    worker = WorkerInfo(0, 1, 0, 0, 1, (0,), device_index=1)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert worker.device == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert worker.device == torch.device("cuda", 1)
    assert WorkerInfo(0, 1, 0, 0, 1, (0,)).device == torch.device("cpu")


def test_environment_patch_puts_back_what_was_there(monkeypatch):
    monkeypatch.setenv("PX_TEST_SET", "before")
    monkeypatch.delenv("PX_TEST_UNSET", raising=False)
    monkeypatch.delenv("PX_TEST_OTHER", raising=False)
    with EnvironmentPatch({"PX_TEST_SET": "a", "PX_TEST_UNSET": "b"},
                          restoring=["PX_TEST_OTHER"]):
        assert (os.environ["PX_TEST_SET"], os.environ["PX_TEST_UNSET"]) == ("a", "b")
        os.environ["PX_TEST_OTHER"] = "set meanwhile"
    assert os.environ["PX_TEST_SET"] == "before"
    assert "PX_TEST_UNSET" not in os.environ and "PX_TEST_OTHER" not in os.environ
    patch = EnvironmentPatch()
    patch.set({"PX_TEST_SET": "x"})
    patch.set({"PX_TEST_SET": "y", "PX_TEST_UNSET": "z"})
    assert os.environ["PX_TEST_SET"] == "y"
    patch.restore()  # the first saved values
    assert os.environ["PX_TEST_SET"] == "before" and "PX_TEST_UNSET" not in os.environ


def test_a_gpu_index_the_host_lacks_is_refused_naming_the_rank(monkeypatch) -> None:
    """Two workers on a one-GPU host (an emulated 1 x 2 cluster gives them GPUs 0 and 1): the
    second is refused with the rank and the remedy, not a CUDA error naming neither."""
    from parallax.cluster import local_spec
    from parallax.errors import ResourceError

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    spec = local_spec(1, 2)

    def worker(rank: int) -> WorkerInfo:
        return WorkerInfo(rank=rank, world_size=2, local_rank=rank, machine=0, num_machines=1,
                          machine_of_rank=spec.machine_of_rank,
                          device_index=spec.device_of_rank(rank))

    assert worker(0).device == torch.device("cuda", 0)
    with pytest.raises(ResourceError, match=r"rank 1 .* given GPU 1, but this host has 1 "
                                            r"visible GPU.*CUDA_VISIBLE_DEVICES="):
        _ = worker(1).device
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert worker(1).device == torch.device("cpu")  # no CUDA: every worker on the CPU


def test_shared_gpus_map_ranks_round_robin_onto_gloo(monkeypatch) -> None:
    """``PARALLAX_SHARED_GPU=1`` (the one-GPU check of multi-rank CUDA paths): the rank that
    was refused above trains on GPU 1 % 1 = 0, and every group is gloo (NCCL refuses two ranks
    on one GPU); without it a CUDA worker's groups are NCCL, a CPU worker's gloo."""
    from parallax.cluster import SHARED_GPU_ENV

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    second = WorkerInfo(1, 2, 1, 0, 1, (0, 0), device_index=1)
    first = WorkerInfo(0, 2, 0, 0, 1, (0, 0), device_index=0)
    monkeypatch.delenv(SHARED_GPU_ENV, raising=False)
    assert first.backend == "nccl"
    monkeypatch.setenv(SHARED_GPU_ENV, "1")
    assert second.device == torch.device("cuda", 0) == first.device
    assert first.backend == second.backend == "gloo"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv(SHARED_GPU_ENV, "0")
    assert first.backend == "gloo" and first.device == torch.device("cpu")
