"""The static profiles: layer and position means, GlobalMean, SourceUniformMean, StaticTopK."""

import torch

from fcaudit import protocol
from fcaudit.kinds import Description
from conftest import T


def test_profiles_global_and_source_uniform_mean():
    a, b = torch.rand(5, T, 1, 1), torch.rand(5, T, 2, 3) - 0.5
    cal = protocol.Calibration([a.double().sum(0), b.double().sum(0)], 5, (None, None))
    assert torch.allclose(cal.layer_mean()[1], b.double().mean((0, 1)))
    assert torch.allclose(cal.layer_position_mean()[1], b.double().mean(0))
    total = (a.double().sum() + b.double().sum()) / (a.numel() + b.numel())
    assert all(torch.allclose(p, total.expand_as(p)) for p in protocol.global_mean(cal))
    su = protocol.source_uniform_mean(cal)[1]
    assert torch.allclose(su.sum(1), cal.layer_mean()[1].sum(1))  # signed sum per stream kept
    assert torch.allclose(su, su[:, :1].expand_as(su))


def test_static_top_k_keeps_the_k_largest_mean_weights_with_the_mean_mass():
    mean = torch.tensor([[0.1, 0.4, 0.0, 0.3, 0.2]], dtype=torch.float64)  # one stream, five experts
    cal = protocol.Calibration([mean * 7], 7, (2,))
    top = protocol.static_top_k(cal)[0]
    assert torch.allclose(top, torch.tensor([[0.0, 4 / 7, 0.0, 3 / 7, 0.0]], dtype=torch.float64))
    assert protocol.for_controller(Description(("expert_router",), top_k=(2,))).count("StaticTopK") == 1
    assert "StaticTopK" not in protocol.for_controller(Description(("source_mixture",)))
