"""Layouts: how a site's output is read as [batch, token, stream, source] and written back, and a layout that
misnames a flattened output's axes."""

import pytest
import torch
from torch import nn

from fcaudit.controllers import Controller, Layout
from fcaudit.errors import FcauditError
from conftest import Block, ToyGated, run


@pytest.mark.parametrize("pattern,shape", [("batch token", (2, 5)), ("stream batch token source", (3, 2, 5, 4)),
                                           ("(batch token) expert", (10, 6)), ("batch token stream", (2, 5, 3))])
def test_layout_round_trip(pattern, shape):
    x = torch.randn(shape)
    lay = Layout.parse(pattern)
    c = lay.encode(x, batch=2, token=5)
    assert c.dim() == 4 and c.shape[:2] == (2, 5)
    assert torch.equal(lay.decode(c, lay.meta(x)), x)
    if pattern.startswith("stream"):
        assert torch.equal(c[1, 3, 2], x[2, 1, 3])  # [batch, token, stream, source]
        permuted = torch.randn(2, 5, 3, 4).permute(2, 0, 1, 3)  # a non-contiguous site output
        back = lay.decode(lay.encode(permuted, 2, 5), lay.meta(permuted))
        assert torch.equal(back, permuted) and back.stride() == permuted.stride()


def test_layout_errors():
    with pytest.raises(FcauditError, match="does not fit layout"):
        Layout.parse("batch token").encode(torch.randn(2, 5, 3), 2, 5)
    with pytest.raises(FcauditError, match="does not fit layout"):
        Layout.parse("(batch token) expert").encode(torch.randn(9, 3), 2, 5)
    with pytest.raises(FcauditError, match="'batch' and a 'token'"):
        Layout.parse("token expert")
    with pytest.raises(FcauditError, match="matches no module"):
        Controller.from_modules(ToyGated(), "blocks.*.router", "batch token")


class FlatRouter(nn.Module):
    """Softmax weights over 4 sources, returned flattened as [(batch token), source]."""

    def __init__(self, d):
        super().__init__()
        self.proj = nn.Linear(d, 4)

    def forward(self, h):
        return torch.softmax(self.proj(h), -1).reshape(-1, 4)


class FlatBlock(Block):
    def __init__(self, d):
        super().__init__(d, FlatRouter(d))
        self.experts = nn.Linear(d, 4 * d)

    def forward(self, h):
        w = self.gate(h).reshape(*h.shape[:2], 4, 1)
        out = self.experts(self.ln(h)).reshape(*h.shape[:2], 4, -1)
        return h + (w * out).sum(2)


def test_a_layout_naming_a_flattened_outputs_axes_in_the_wrong_order_is_refused(tmp_path):
    model = ToyGated()
    model.blocks = nn.ModuleList(FlatBlock(16) for _ in range(2))
    wrong = Controller.from_modules(model, "blocks.*.gate", layout="(token batch) source")
    with pytest.raises(FcauditError, match=r"'\(token batch\) source' names the output's axes"):
        run(model, wrong, tmp_path / "a")
    right = run(model, Controller.from_modules(model, "blocks.*.gate", layout="(batch token) source"), tmp_path / "b")
    assert right.replay.bit_equal
