"""`parallax.meta_init`: a model built without its large tensors, whose recorded initialisation
replays, row by row, to the very values the single-device program's construction gives."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import parallax
from parallax.checkpoint import export
from parallax.errors import UnsupportedProgramError
from parallax.model import meta_init as meta


class EveryInit(nn.Module):
    """One parameter per initialisation meta_init replays, with awkward sizes (row counts
    and row lengths that are not multiples of 16, one row, one element per row)."""

    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(1001, 7, padding_idx=3)
        self.bag = nn.EmbeddingBag(333, 5, padding_idx=0)
        self.linear = nn.Linear(7, 9)
        self.scaled = nn.Parameter(torch.randn(500, 9) * 0.01)
        self.uniform = nn.Parameter(torch.rand(37, 3, 2))
        self.xavier = nn.Parameter(torch.empty(300, 4))
        nn.init.xavier_uniform_(self.xavier)
        self.kaiming = nn.Parameter(torch.empty(64, 33))
        nn.init.kaiming_normal_(self.kaiming)
        self.shifted = nn.Parameter(torch.zeros(100, 3))
        self.column = nn.Parameter(torch.empty(17, 1))
        nn.init.normal_(self.column, mean=2.0, std=0.5)
        self.row = nn.Parameter(torch.full((1, 40), 0.25))
        with torch.no_grad():
            self.xavier[5] = 0.5
            self.xavier[7:9] = -1
            self.shifted.add_(2.0).clamp_(max=1.5)
        self.lstm = nn.LSTM(4, 6)
        self.register_buffer("counts", torch.ones(50, 2))


@pytest.fixture(params=[48, 1 << 20], ids=["many-chunks", "one-chunk"])
def chunk_elements(request, monkeypatch):
    monkeypatch.setattr(meta, "_CHUNK_ELEMENTS", request.param)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_replay_equals_the_materialised_program_bitwise(chunk_elements, dtype):
    """Every parameter's and buffer's values, whole and as rows in any order, equal the plain
    construction's bit for bit; the random stream continues where the plain program's does."""
    torch.manual_seed(1)
    plain = EveryInit().to(dtype)
    after_plain = torch.rand(5)
    torch.manual_seed(1)
    with parallax.meta_init(threshold_bytes=0):
        deferred = EveryInit().to(dtype)
    assert torch.equal(torch.rand(5), after_plain)
    for (name, want), got in zip(plain.state_dict().items(), deferred.state_dict().values(),
                                 strict=True):
        assert got.device.type == "meta", name
        recipe = meta.recipe_of(got)
        assert recipe is not None, name
        assert torch.equal(recipe.materialise(), want), f"{name}: {recipe.describe()}"
        ids = torch.tensor([want.shape[0] - 1, 0, want.shape[0] // 2, 0])
        assert torch.equal(recipe.rows(ids), want[ids]), name


def test_an_explicit_generator_is_replayed_and_advanced(chunk_elements):
    generator = torch.Generator().manual_seed(7)
    plain = nn.init.uniform_(torch.empty(999, 3), generator=generator)
    after = torch.rand(4, generator=generator)
    generator.manual_seed(7)
    with parallax.meta_init(threshold_bytes=0):
        deferred = nn.init.uniform_(torch.empty(999, 3), generator=generator)
    assert torch.equal(torch.rand(4, generator=generator), after)
    assert torch.equal(meta.recipe_of(deferred).materialise(), plain)


def test_only_tensors_over_the_threshold_are_deferred():
    with parallax.meta_init(threshold_bytes=4000):
        small = nn.Embedding(10, 4)    # 160 bytes: built for real
        large = nn.Embedding(1000, 4)  # 16,000 bytes: deferred
    assert small.weight.device.type == "cpu"
    assert large.weight.device.type == "meta"


@pytest.mark.parametrize("build, named", [
    (lambda: nn.init.trunc_normal_(torch.empty(100, 4)), "reading a value"),
    (lambda: nn.init.orthogonal_(torch.empty(100, 4)), "copy_"),
    (lambda: nn.init.sparse_(torch.empty(100, 4), sparsity=0.5), "index_put_"),
    (lambda: torch.empty(100, 4).copy_(torch.ones(100, 4)), "by a tensor"),
    (lambda: torch.empty(100, 4)[:10].normal_(), "on part of the tensor"),
    (lambda: torch.empty(100, 4)[:, 1].fill_(0), "not whole rows"),
    (lambda: torch.empty(100, 4).exponential_(), "exponential_"),
])
def test_an_initialisation_that_cannot_replay_is_refused_where_it_happens(build, named):
    with pytest.raises(UnsupportedProgramError, match="meta_init") as error:
        with parallax.meta_init(threshold_bytes=0):
            build()
    assert named in str(error.value)


def test_a_tensor_never_initialised_or_built_on_meta_alone_is_named():
    with parallax.meta_init(threshold_bytes=0):
        never = torch.empty(100, 4)
    with pytest.raises(UnsupportedProgramError, match="never initialised"):
        meta.recipe_of(never).materialise()
    with torch.device("meta"):
        model = nn.Sequential(nn.Embedding(100, 4), nn.Linear(4, 2))
    with pytest.raises(UnsupportedProgramError, match=r"'0.weight' is on the meta device"):
        parallax.distribute(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            config=parallax.Config(partition_cache=None))
    parallax.shutdown()


class Lookup(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embedding = nn.Embedding(200, 6)
        self.head = nn.Linear(6, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embedding(ids).mean(dim=1))


def test_a_deferred_model_trains_as_the_materialised_one(tmp_path, monkeypatch):
    """Through parallax.distribute: the table stays storage-less in the user's model (the
    server made its rows from the recipe), the linear layer gets its values, Adagrad's
    constructor state is rebuilt for it, and training equals the plain program's."""
    torch.manual_seed(0)
    reference = Lookup().double()
    reference_optimizer = torch.optim.Adagrad(reference.parameters(), lr=0.1,
                                              initial_accumulator_value=0.2)
    torch.manual_seed(0)
    with parallax.meta_init(threshold_bytes=0):
        model = Lookup().double()
    optimizer = torch.optim.Adagrad(model.parameters(), lr=0.1, initial_accumulator_value=0.2)
    try:
        distributed, optimizer = parallax.distribute(
            model, optimizer, config=parallax.Config(partition_cache=None))
        assert model.embedding.weight.device.type == "meta"
        assert model.head.weight.device.type == "cpu"
        assert optimizer.state[model.head.weight]["sum"].device.type == "cpu"
        generator = torch.Generator().manual_seed(3)
        for _ in range(4):
            ids = torch.randint(200, (8, 5), generator=generator)
            target = torch.randint(3, (8,), generator=generator)
            for net, opt in ((distributed, optimizer), (reference, reference_optimizer)):
                opt.zero_grad()
                nn.functional.cross_entropy(net(ids), target).backward()
                opt.step()
        got = distributed.state_dict()
        for name, want in reference.state_dict().items():
            torch.testing.assert_close(got[name], want, rtol=1e-12, atol=0)
        # streamed export: 7 rows per exchange, the same values as state_dict
        monkeypatch.setattr(export, "_CHUNK_BYTES", 7 * 6 * 8)
        path = distributed.runner.export(tmp_path / "out" / "model.pt")
        exported = torch.load(path, mmap=True)
        assert exported.keys() == got.keys()
        for name, value in got.items():
            assert torch.equal(exported[name], value), name
        assert [p.name for p in path.parent.iterdir()] == ["model.pt"]  # no scratch left
    finally:
        parallax.shutdown()
