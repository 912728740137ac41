"""A copy's parameters made from the state as its ops use them (dpcompare.verify.oracle.weights_on_use): the gradients
are the whole load's to the bit, the copy holds a module's weights at a time, and a twin that reads other values in
backward is caught by the same comparison."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpcompare.run.real_models import GPT, GPT_SIZES
from dpcompare.verify.judgement.held_values import releasable
from dpcompare.verify.oracle import weights_on_use
from dpcompare.verify.oracle.gradient_oracle import Oracle, global_pieces, loaded, verification_copy

CPU = torch.device("cpu")


class _Loss(nn.Module):
    """A model whose forward returns its own scalar loss (a transformers model given labels)."""

    def __init__(self, inner: nn.Module, labels: bool = True) -> None:
        super().__init__()
        self.inner, self.labels = inner, labels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.inner(input_ids=x, labels=x) if self.labels else self.inner(x)
        return out.loss if hasattr(out, "loss") else out.double().square().mean()


def _grads(template: nn.Module, x: torch.Tensor, on_use: bool, dtype=torch.float64, seed: int = 5):
    """The copy's gradients after one forward and backward from the template's state, and the bytes made at most."""
    state = {k: v.detach().clone() for k, v in template.state_dict().items()}
    copy = releasable(verification_copy(template, CPU, dtype))
    with loaded(copy, state, on_use) as maker:
        copy.train()
        torch.manual_seed(seed)
        out = copy(x)
        (out if out.dim() == 0 else out.double().square().mean()).backward()
    grads = {n: p.grad.clone() for n, p in copy.named_parameters() if p.grad is not None}
    released = all(p.untyped_storage().nbytes() == 0 for p in copy.parameters())
    return grads, getattr(maker, "peak_bytes", None), released, copy


def _llama(checkpointing: str | None) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    model.config.use_cache = False
    if checkpointing is not None:
        kwargs = {"use_reentrant": checkpointing == "reentrant"}
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return _Loss(model)


GPT_CONFIG = GPT_SIZES[sorted(GPT_SIZES)[0]]


def _gpt() -> nn.Module:
    torch.manual_seed(0)
    return GPT(GPT_CONFIG)


class _Scalars(nn.Module):
    """A 0-dim parameter, a frozen one and one no gradient reaches beside a linear layer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 3)
        self.gain = nn.Parameter(torch.tensor(1.5))
        self.frozen = nn.Parameter(torch.randn(3), requires_grad=False)
        self.unused = nn.Parameter(torch.randn(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.gain + self.frozen


CASES = {
    "mlp": (lambda: nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.LayerNorm(32), nn.Linear(32, 4)),
            lambda: torch.randn(5, 8)),
    "scalars": (_Scalars, lambda: torch.randn(4, 6)),
    # the tied head multiplies by the embedding's weight in the model's own forward; blocks recomputed in backward
    "gpt-tied-recomputed": (_gpt, lambda: torch.randint(0, GPT_CONFIG.vocab, (2, 16))),
    "llama": (lambda: _llama(None), lambda: torch.randint(0, 512, (2, 12))),
    "llama-reentrant": (lambda: _llama("reentrant"), lambda: torch.randint(0, 512, (2, 12))),
    "llama-non-reentrant": (lambda: _llama("non-reentrant"), lambda: torch.randint(0, 512, (2, 12))),
}


@pytest.mark.parametrize("case", list(CASES))
def test_made_on_use_is_the_whole_load_to_the_bit(case: str) -> None:
    build, batch = CASES[case]
    template = build()
    torch.manual_seed(1)
    x = batch()
    whole, _, _, _ = _grads(template, x, on_use=False)
    made, peak, released, copy = _grads(template, x, on_use=True)
    assert weights_on_use.eligible(copy)
    assert whole.keys() == made.keys() and whole, case
    assert [n for n in whole if not torch.equal(whole[n], made[n])] == [], case
    assert released, "a parameter was left made after the copy was let go"
    total = sum(p.numel() * 8 for p in copy.parameters())
    if case.startswith(("llama", "gpt")):  # the embedding (tied: the head) and a block at a time, not the model
        assert peak < 0.7 * total, (peak, total)


def test_a_twin_that_reads_other_values_in_backward_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """The comparison the test above makes fails for a maker whose backward reads a parameter made from values one
    unit in the last place away (what a stale or wrongly filled weight would give)."""
    template = _llama(None)
    x = torch.randint(0, 512, (2, 12))
    whole, _, _, _ = _grads(template, x, on_use=False)
    real = weights_on_use._Maker._make

    def stale(self, p):
        real(self, p)
        if torch._C._current_autograd_node() is not None:
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(p):
                p.copy_(torch.nextafter(p, torch.full_like(p, float("inf"))))

    monkeypatch.setattr(weights_on_use._Maker, "_make", stale)
    made, _, _, _ = _grads(template, x, on_use=True)
    differ = [n for n in whole if not torch.equal(whole[n], made[n])]
    assert differ, "a weight read one ulp off in backward changed no gradient"


def test_a_model_that_loads_its_own_way_is_loaded_whole() -> None:
    """spectral_norm loads its state with hooks of its own: the copy is loaded whole, as before."""
    model = nn.Sequential(nn.utils.spectral_norm(nn.Linear(4, 4)), nn.Linear(4, 2))
    copy = releasable(verification_copy(model, CPU, torch.float64))
    assert not weights_on_use.eligible(copy)
    state = model.state_dict()
    with loaded(copy, state) as maker:
        assert maker is None
        assert all(p.untyped_storage().nbytes() for p in copy.parameters())


def test_a_state_with_a_wrong_key_is_refused_as_a_load_refuses_it() -> None:
    model = nn.Sequential(nn.Linear(4, 4))
    copy = releasable(verification_copy(model, CPU, torch.float64))
    state = {**model.state_dict(), "extra": torch.zeros(1)}
    with pytest.raises(RuntimeError, match="Unexpected key"):
        with loaded(copy, state):
            pass
    assert all(p.untyped_storage().nbytes() == 0 for p in copy.parameters())


def test_the_oracle_computes_the_same_gradient_with_its_weights_made_on_use(monkeypatch) -> None:
    """Oracle.oracle_of and floor_of (float64 and the run's precision): the same gradients whether the copies are
    loaded whole or made on use."""
    template = _gpt()
    state = {k: v.detach().clone() for k, v in template.state_dict().items()}
    x = torch.randint(0, GPT_CONFIG.vocab, (4, 16))
    y = torch.randint(0, GPT_CONFIG.vocab, (4, 16))
    loss = lambda out, t: nn.functional.cross_entropy(out.flatten(0, 1), t.flatten())  # noqa: E731
    results = {}
    for on_use in (False, True):
        if not on_use:
            monkeypatch.setattr(weights_on_use, "eligible", lambda m: False)
        else:
            monkeypatch.undo()
        oracle = Oracle(template, loss, "float32", CPU)
        torch.manual_seed(3)
        g64 = {k: v.clone() for k, v in oracle.oracle_of(state, global_pieces((x, y))).items()}
        torch.manual_seed(3)
        grun = {k: v.clone() for k, v in oracle.floor_of(state, global_pieces((x, y))).items()}
        results[on_use] = (g64, grun)
    for a, b in zip(results[False], results[True]):
        assert a.keys() == b.keys()
        assert [n for n in a if not torch.equal(a[n], b[n])] == []
