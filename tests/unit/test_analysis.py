"""Tests for parallax.model.detect: which parameters are sparse, and the gather rewrite."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

from parallax.model.detect import (
    BatchDependent,
    SparseUse,
    batch_dependent_reads,
    find_sparse_parameters,
    rewrite_gathers,
)

VOCAB, DIM = 20, 6


def _ids(*shape: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, shape, generator=g)


# --------------------------------------------------------------------------------------------
# models
# --------------------------------------------------------------------------------------------


class EmbModel(nn.Module):
    def __init__(self, sparse: bool = False) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM, sparse=sparse)
        self.bag = nn.EmbeddingBag(VOCAB, DIM, mode="sum", sparse=not sparse)
        self.proj = nn.Linear(DIM, 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.proj(self.emb(ids).mean(1) + self.bag(ids))


class TiedModel(nn.Module):
    """Input and output embedding share one Parameter (registered twice)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.out = nn.Linear(DIM, VOCAB, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.emb(ids))


class ReadInForwardModel(nn.Module):
    """Output projection reads the embedding's weight directly in forward."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.other = nn.Embedding(VOCAB, DIM)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids) + self.other(ids)
        return h @ self.emb.weight.t()


class MaxNormModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM, max_norm=1.0)
        self.freq = nn.Embedding(VOCAB, DIM, scale_grad_by_freq=True)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb(ids) + self.freq(ids)


class GatherModel(nn.Module):
    """Custom Parameters gathered in the three supported styles, plus dense neighbours."""

    def __init__(self, padding_idx: int | None = None) -> None:
        super().__init__()
        self.padding_idx = padding_idx
        self.w_emb = nn.Parameter(torch.randn(VOCAB, DIM))
        self.w_item = nn.Parameter(torch.randn(VOCAB, DIM))
        self.tables = nn.Module()
        self.tables.w_sel = nn.Parameter(torch.randn(VOCAB, DIM))
        self.w_meth = nn.Parameter(torch.randn(VOCAB, DIM))
        self.proj = nn.Linear(DIM, 2)
        self.scale = nn.Parameter(torch.ones(DIM))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        a = F.embedding(ids, self.w_emb, padding_idx=self.padding_idx)
        b = self.w_item[ids]
        flat = ids.reshape(-1)
        c = torch.index_select(self.tables.w_sel, 0, flat).view_as(a)
        d = self.w_meth.index_select(dim=0, index=flat).view_as(a)
        return self.proj((a + b + c + d) * self.scale)


class MixedUseModel(nn.Module):
    """``w`` is gathered and also multiplied; ``v`` is sliced; ``u`` is gathered by an int."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(VOCAB, DIM))
        self.v = nn.Parameter(torch.randn(VOCAB, DIM))
        self.u = nn.Parameter(torch.randn(VOCAB, DIM))
        self.t = nn.Parameter(torch.randn(VOCAB, DIM))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = F.embedding(ids, self.w)
        logits = h @ self.w.t()
        sliced = self.v[:4].sum()
        one_row = self.u[ids.shape[0]]
        masked = self.t[ids[0] > 3].sum()
        return logits.sum() + sliced + one_row.sum() + masked


class UntraceableModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.emb(ids)
        if h.sum() > 0:  # data-dependent control flow: symbolic_trace raises
            h = self.lin(h)
        return h


class FrozenModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.emb.weight.requires_grad_(False)
        self.w = nn.Parameter(torch.randn(VOCAB, DIM), requires_grad=False)
        self.live = nn.Embedding(VOCAB, DIM)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.emb(ids) + self.w[ids] + self.live(ids)


# --------------------------------------------------------------------------------------------
# find_sparse_parameters
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("sparse", [False, True])
def test_embedding_and_bag_detected(sparse: bool) -> None:
    uses = find_sparse_parameters(EmbModel(sparse=sparse))
    assert uses == {
        "emb.weight": SparseUse("emb.weight", "embedding", "emb", VOCAB, sparse),
        "bag.weight": SparseUse("bag.weight", "embedding_bag", "bag", VOCAB, not sparse),
    }


def test_tied_embedding_is_dense() -> None:
    assert find_sparse_parameters(TiedModel()) == {}


def test_embedding_weight_read_in_forward_is_dense() -> None:
    uses = find_sparse_parameters(ReadInForwardModel())
    assert list(uses) == ["other.weight"]


def test_max_norm_and_scale_grad_by_freq_are_sparse_with_their_options() -> None:
    uses = find_sparse_parameters(MaxNormModel())
    assert uses == {
        "emb.weight": SparseUse("emb.weight", "embedding", "emb", VOCAB, False,
                                BatchDependent(max_norm=1.0)),
        "freq.weight": SparseUse("freq.weight", "embedding", "freq", VOCAB, False,
                                 BatchDependent(scale_grad_by_freq=True)),
    }
    assert uses["emb.weight"].batch_dependent.describe() == "max_norm=1.0"


def test_batch_dependent_reads_name_every_parameter_and_where() -> None:
    class Tied(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(VOCAB, DIM, max_norm=1.0, norm_type=1.0)
            self.head = nn.Linear(DIM, VOCAB)
            self.head.weight = self.emb.weight
            self.w = nn.Parameter(torch.randn(VOCAB, DIM))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            x = self.emb(ids) + F.embedding(ids, self.w, scale_grad_by_freq=True)
            return self.head(x)

    reads = batch_dependent_reads(Tied())
    assert reads == {"emb.weight": ("emb", BatchDependent(1.0, 1.0, False)),
                     "w": ("F.embedding", BatchDependent(scale_grad_by_freq=True))}
    assert reads["emb.weight"][1].describe() == "max_norm=1.0, norm_type=1.0"


def test_gathers_of_one_parameter_with_different_options_are_refused() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(VOCAB, DIM))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return F.embedding(ids, self.w, max_norm=1.0) + F.embedding(ids, self.w)

    with pytest.raises(ValueError, match=r"parameter 'w' is looked up with different "
                                         r"batch-dependent options \(max_norm=1.0; none\)"):
        find_sparse_parameters(M())


def test_custom_gathers_detected() -> None:
    uses = find_sparse_parameters(GatherModel())
    assert uses == {
        name: SparseUse(name, "gather", None, VOCAB, False)
        for name in ("w_emb", "w_item", "tables.w_sel", "w_meth")
    }


def test_functional_embedding_sparse_flag_and_options() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Parameter(torch.randn(VOCAB, DIM))
            self.b = nn.Parameter(torch.randn(VOCAB, DIM))
            self.c = nn.Parameter(torch.randn(VOCAB, DIM))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            a = F.embedding(ids, weight=self.a, sparse=True, padding_idx=0)
            b = F.embedding(ids, self.b, max_norm=1.0)
            c = F.embedding(ids, self.c, scale_grad_by_freq=True)
            return a + b + c

    uses = find_sparse_parameters(M())
    assert uses == {"a": SparseUse("a", "gather", None, VOCAB, True),
                    "b": SparseUse("b", "gather", None, VOCAB, False, BatchDependent(1.0)),
                    "c": SparseUse("c", "gather", None, VOCAB, False,
                                   BatchDependent(scale_grad_by_freq=True))}


def test_gather_and_other_uses_are_dense() -> None:
    # matmul, slice, int index and boolean mask all disqualify the parameter.
    assert find_sparse_parameters(MixedUseModel()) == {}


def test_untraceable_model_uses_module_rule_and_notes_it_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """One INFO note (rank 0 alone prints INFO: `parallax.logs`), not a warning on every
    rank (on 26b56e5 every rank of every Hugging Face run printed it)."""
    with pytest.raises(Exception):  # noqa: B017 - the precise trace error is torch's business
        fx.symbolic_trace(UntraceableModel())
    with caplog.at_level(logging.INFO, logger="parallax"):
        uses = find_sparse_parameters(UntraceableModel())
    assert uses == {"emb.weight": SparseUse("emb.weight", "embedding", "emb", VOCAB, False)}
    records = [r for r in caplog.records if r.name == "parallax"]
    assert len(records) == 1
    message = records[0].getMessage()
    assert records[0].levelno == logging.INFO
    assert "UntraceableModel" in message and "module rule only" in message
    assert "\n" not in message


def test_untraceable_model_still_excludes_ties_and_keeps_max_norm(
    caplog: pytest.LogCaptureFixture,
) -> None:
    class M(UntraceableModel):
        def __init__(self) -> None:
            super().__init__()
            self.tied = nn.Embedding(VOCAB, DIM)
            self.head = nn.Linear(DIM, VOCAB)
            self.head.weight = self.tied.weight
            self.normed = nn.EmbeddingBag(VOCAB, DIM, max_norm=2.0)

    with caplog.at_level(logging.WARNING, logger="parallax"):
        uses = find_sparse_parameters(M())
    assert list(uses) == ["emb.weight", "normed.weight"]
    assert uses["normed.weight"].batch_dependent == BatchDependent(max_norm=2.0)


def test_frozen_parameters_excluded() -> None:
    assert list(find_sparse_parameters(FrozenModel())) == ["live.weight"]


def test_shared_embedding_module_stays_sparse() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(VOCAB, DIM)
            self.alias = self.emb  # same module under two names: not a tie

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.emb(ids) + self.alias(ids)

    assert find_sparse_parameters(M()) == {
        "emb.weight": SparseUse("emb.weight", "embedding", "emb", VOCAB, False)
    }


def test_custom_parameter_inside_called_leaf_module_is_dense() -> None:
    # The Linear reads its weight opaquely, so a gather of the same weight elsewhere must not
    # make it sparse.
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(DIM, DIM)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.lin(self.lin.weight[ids])

    assert find_sparse_parameters(M()) == {}


def test_embedding_subclass_and_parameter_list_are_gathers() -> None:
    # User subclasses of nn.Embedding are traced through (not fx leaves), so the weight shows
    # up as an F.embedding gather; ParameterList entries are ordinary get_attr parameters.
    class MyEmbedding(nn.Embedding):
        pass

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = MyEmbedding(VOCAB, DIM, padding_idx=2, sparse=True)
            self.tables = nn.ParameterList([nn.Parameter(torch.randn(VOCAB, 3))])

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.emb(ids).sum(-1) + self.tables[0][ids].sum(-1)

    model = M()
    assert find_sparse_parameters(model) == {
        "emb.weight": SparseUse("emb.weight", "gather", None, VOCAB, True),
        "tables.0": SparseUse("tables.0", "gather", None, VOCAB, False),
    }
    rewritten, made = _rewrite(model)
    ids = _ids(3, 4)
    torch.testing.assert_close(rewritten(ids), model(ids), rtol=0, atol=0)
    assert made["emb.weight"].seen_padding_idx == [2]
    assert not hasattr(rewritten, "emb") and not hasattr(rewritten, "tables")


# --------------------------------------------------------------------------------------------
# rewrite_gathers
# --------------------------------------------------------------------------------------------


class PlainGather(nn.Module):
    """Reference replacement: the gather the model did, recording padding_idx it was given."""

    def __init__(self, weight: nn.Parameter) -> None:
        super().__init__()
        self.weight = weight
        self.seen_padding_idx: list[int | None] = []

    def forward(self, ids: torch.Tensor, padding_idx: int | None = None) -> torch.Tensor:
        self.seen_padding_idx.append(padding_idx)
        return F.embedding(ids, self.weight, padding_idx=padding_idx)


def _rewrite(model: nn.Module) -> tuple[nn.Module, dict[str, PlainGather]]:
    made: dict[str, PlainGather] = {}

    def make_gather(name: str) -> nn.Module:
        made[name] = PlainGather(model.get_parameter(name))
        return made[name]

    return rewrite_gathers(model, find_sparse_parameters(model), make_gather), made


@pytest.mark.parametrize("padding_idx", [None, 3, -1])
def test_rewrite_matches_original(padding_idx: int | None) -> None:
    torch.manual_seed(0)
    model = GatherModel(padding_idx=padding_idx)
    rewritten, made = _rewrite(model)
    assert isinstance(rewritten, fx.GraphModule)
    assert sorted(made) == ["tables.w_sel", "w_emb", "w_item", "w_meth"]

    ids = _ids(4, 5)
    ids[0, 0] = 3 if padding_idx is None else padding_idx % VOCAB
    torch.testing.assert_close(rewritten(ids), model(ids), rtol=0, atol=0)

    # Same gradients too (padding row gets none when padding_idx is used).
    model.zero_grad()
    model(ids).sum().backward()
    expected = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    rewritten(ids).sum().backward()
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, expected[n], rtol=0, atol=0)

    want = None if padding_idx is None else padding_idx % VOCAB
    assert made["w_emb"].seen_padding_idx[-1] == want
    for name in ("w_item", "tables.w_sel", "w_meth"):
        assert made[name].seen_padding_idx[-1] is None


def test_rewrite_shares_dense_state_and_drops_sparse_parameters() -> None:
    model = GatherModel()
    rewritten, made = _rewrite(model)
    assert rewritten.proj is model.proj
    assert rewritten.proj.weight is model.proj.weight
    assert rewritten.scale is model.scale

    sparse = {id(model.get_parameter(n)) for n in made}
    via_graph = [
        (n, p) for n, p in rewritten.named_parameters() if not n.startswith("_parallax_gather_")
    ]
    assert {id(p) for _, p in via_graph} == {
        id(model.proj.weight),
        id(model.proj.bias),
        id(model.scale),
    }
    assert not sparse & {id(p) for _, p in via_graph}
    assert not hasattr(rewritten, "w_emb") and not hasattr(rewritten, "tables")
    get_attrs = [n.target for n in rewritten.graph.nodes if n.op == "get_attr"]
    assert get_attrs == ["scale"]
    assert isinstance(rewritten._parallax_gather_tables_w_sel, PlainGather)
    calls = [n.target for n in rewritten.graph.nodes if n.op == "call_module"]
    gathers = [f"_parallax_gather_{n.replace('.', '_')}" for n in made]
    assert sorted(calls) == sorted([*gathers, "proj"])
    # The original model is untouched.
    assert isinstance(model.w_emb, nn.Parameter) and isinstance(model.tables.w_sel, nn.Parameter)


def test_rewrite_without_gathers_returns_model() -> None:
    model = EmbModel()
    assert rewrite_gathers(model, find_sparse_parameters(model), lambda n: nn.Identity()) is model


def test_rewrite_rejects_stale_uses() -> None:
    model = MixedUseModel()
    stale = {"w": SparseUse("w", "gather", None, VOCAB, False)}
    with pytest.raises(ValueError, match="not a row gather"):
        rewrite_gathers(model, stale, lambda n: nn.Identity())
    with pytest.raises(ValueError, match="not a parameter"):
        rewrite_gathers(model, {"nope": SparseUse("nope", "gather", None, 1, False)}, print)


def test_rewrite_rejects_leaf_module_reads_and_name_clashes() -> None:
    class Leafy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(DIM, DIM)

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.lin(self.lin.weight[ids])

    stale = {"lin.weight": SparseUse("lin.weight", "gather", None, DIM, False)}
    with pytest.raises(ValueError, match="read inside module 'lin'"):
        rewrite_gathers(Leafy(), stale, lambda n: nn.Identity())

    class Clash(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Module()
            self.a.b = nn.Parameter(torch.randn(VOCAB, DIM))
            self.a_b = nn.Parameter(torch.randn(VOCAB, DIM))

        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.a.b[ids] + self.a_b[ids]

    model = Clash()
    with pytest.raises(ValueError, match="both map"):
        rewrite_gathers(model, find_sparse_parameters(model), lambda n: nn.Identity())


class _ReadsItsShape(nn.Module):
    """A sampled-softmax style layer that reads its weight's shape beside the gather."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(VOCAB, 4))

    def forward(self, ids: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.reshape(-1, self.weight.shape[1]) * self.weight.size(1) / self.weight.dim()
        return hidden @ self.weight[ids].t()


def test_reading_the_shape_of_a_gathered_weight_keeps_it_sparse() -> None:
    model = _ReadsItsShape()
    uses = find_sparse_parameters(model)
    assert uses["weight"].kind == "gather"
    table = model.weight.detach().clone()

    class Gather(nn.Module):
        def forward(self, ids: torch.Tensor, padding_idx: int | None = None) -> torch.Tensor:
            return F.embedding(ids, table)

    rewritten = rewrite_gathers(model, uses, lambda name: Gather())
    assert "weight" not in dict(rewritten.named_parameters())  # the shape became a constant
    ids, hidden = _ids(6), torch.randn(3, 4)
    assert torch.equal(rewritten(ids, hidden), model(ids, hidden))
