"""PackedLinear: oneDNN-prepacked weights give what nn.Linear gives, in the model worker too."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from factories import Driver, make_prompts, new_seq
from worker.model.transformers import packed_linear
from worker.model.transformers.backend import TransformersBackend
from worker.model.transformers.packed_linear import PackedLinear, pack_linears

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                reason="this torch has no oneDNN")


@pytest.mark.parametrize("rows", [1, 5, 64, 300])
def test_a_packed_linear_computes_what_linear_computes(rows):
    torch.manual_seed(0)
    lin = nn.Linear(48, 80, bias=True)
    x = torch.randn(2, rows, 48)   # any leading shape, any row count (packed for 64)
    with torch.inference_mode():
        want, got = lin(x), PackedLinear(lin)(x)
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_packed_model_decodes_a_mixed_batch_as_the_plain_model_does(sharp_model):
    model, info = sharp_model
    packed = copy.deepcopy(model)
    n = pack_linears(packed)
    assert n == sum(isinstance(m, nn.Linear) for m in model.modules()) > 0
    assert not any(isinstance(m, nn.Linear) for m in packed.modules())
    prompts = make_prompts(6, lengths=[3, 17, 40, 9, 25, 60], vocab=info.vocab_size)
    runs = []
    for m in (model, packed):
        d = Driver(TransformersBackend(m, info, max_num_seqs=8))
        d.step(prefill=[new_seq(f"s{i}", p) for i, p in enumerate(prompts[:4])])
        for _ in range(3):
            d.step()
        d.step(prefill=[new_seq(f"s{i}", p) for i, p in enumerate(prompts[4:], start=4)])
        for _ in range(6):
            d.step()
        runs.append(d.outputs)
    assert runs[0] == runs[1]


def test_packing_leaves_the_model_alone_when_onednn_fails(monkeypatch):
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))

    class Broken(PackedLinear):
        def forward(self, x):
            return super().forward(x) + 1.0   # a torch whose packed result is wrong

    monkeypatch.setattr(packed_linear, "PackedLinear", Broken)
    assert pack_linears(model) == 0
    assert [type(m) for m in model] == [nn.Linear, nn.ReLU, nn.Linear]


def test_the_model_worker_packs_only_on_a_cpu_when_asked(monkeypatch, tiny_model_dir):
    from common.settings import Settings

    for on in (True, False):
        w = TransformersBackend.load(Settings(model=tiny_model_dir, device="cpu", dtype="float32",
                                      packed_linears=on, prefix_cache_mb=0))
        assert any(isinstance(m, PackedLinear) for m in w.model.modules()) is on


def test_only_plain_linear_layers_are_packed():
    # MultiheadAttention reads out_proj.weight itself: its Linear subclass must stay.
    model = nn.ModuleDict({"attn": nn.MultiheadAttention(8, 2), "head": nn.Linear(8, 3)})
    assert pack_linears(model) == 1
    assert isinstance(model["head"], PackedLinear)
    assert type(model["attn"].out_proj) is nn.modules.linear.NonDynamicallyQuantizableLinear
    x = torch.randn(4, 1, 8)
    with torch.inference_mode():
        model["attn"](x, x, x)   # still runs
