"""torch's errors that a parallax program meets through the engine, said in parallax's terms
(`parallax.step.torch_errors`): each names the rank, the step and the parallax fix, with the
original chained; an error it does not know goes on unchanged."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from parallax.errors import UnsupportedProgramError
from parallax.step.torch_errors import TorchErrors, ddp_parameter_names

DDP_UNUSED = (
    "Expected to have finished reduction in the prior iteration before starting a new one. "
    "This error indicates that your module has parameters that were not used in producing "
    "loss. You can enable unused parameter detection by passing the keyword argument "
    "`find_unused_parameters=True` to `torch.nn.parallel.DistributedDataParallel`, ...\n"
    "Parameter indices which did not receive grad for rank 1: 2 3\n")


def _raised(message: str) -> BaseException:
    errors = TorchErrors(1, torch.device("cpu"), lambda: 3,
                         lambda: ["a.weight", "a.bias", "b.weight", "b.bias"])
    with pytest.raises(BaseException) as caught, errors:
        raise RuntimeError(message)
    return caught.value


def test_unused_parameters_name_the_layer_and_config_find_unused_parameters() -> None:
    error = _raised(DDP_UNUSED)
    assert isinstance(error, UnsupportedProgramError)
    assert str(error).startswith("rank 1: the dense parameter(s) ['b.weight', 'b.bias'] got "
                                 "no gradient in step 2")
    assert "parallax.Config(find_unused_parameters=True)" in str(error)
    assert isinstance(error.__cause__, RuntimeError)


def test_ready_twice_and_device_mismatches_name_their_fix() -> None:
    twice = _raised("Expected to mark a variable ready only once. This error is caused by ...")
    assert "use_reentrant=False" in str(twice) and "step 3" in str(twice)
    devices = _raised("Expected all tensors to be on the same device, but found at least two "
                      "devices, cuda:0 and cpu!")
    assert "This worker's model runs on cpu" in str(devices)


def test_other_errors_go_on_unchanged() -> None:
    error = _raised("some other failure")
    assert type(error) is RuntimeError and str(error) == "some other failure"


def test_ddps_parameter_order_skips_frozen_and_ignored_parameters() -> None:
    assert ddp_parameter_names(nn.Linear(2, 2)) == []  # no DDP: no names
    module = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    module[0].bias.requires_grad_(False)

    class FakeDDP(nn.parallel.DistributedDataParallel):
        def __init__(self, inner: nn.Module) -> None:  # no process group needed
            nn.Module.__init__(self)
            self.module = inner
            self.parameters_to_ignore = {"1.bias"}

    assert ddp_parameter_names(FakeDDP(module)) == ["0.weight", "1.weight"]


def test_an_uncaught_ddp_error_of_the_own_loops_backward_is_explained(single_process) -> None:
    """DDP's error raised in the program's own ``loss.backward()`` (no parallax call around
    it) is explained after its traceback by the current run's runner."""
    import parallax
    from parallax.engine.diagnostics.failing import explained

    model = nn.Sequential(nn.Embedding(10, 2), nn.Linear(2, 1))
    parallax.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                        config=parallax.Config(partition_cache=None))
    said = explained(RuntimeError(DDP_UNUSED))
    assert said is not None and said.startswith("rank 0: some dense parameters got no gradient")
    assert "find_unused_parameters=True" in said
    assert explained(ValueError("not torch's")) is None
