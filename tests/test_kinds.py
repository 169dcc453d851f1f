"""The active count of a controller's coefficients (fcaudit.kinds.Description.active)."""

import numpy as np
import torch

from fcaudit.kinds import Description


def test_active_counts_nonzero_sources_as_count_nonzero_does():
    """Per window, the mean over sites of the nonzero sources per (token, stream): nan counts, -0.0 does not; the
    same bits for float32, bf16, strided and expanded (static-profile) coefficients, and over the routers only."""
    g = torch.Generator().manual_seed(0)
    a = torch.randn(5, 7, 3, 4, generator=g)
    a[a.abs() < 0.7] = 0.0
    a[0, 0, 0, 0], a[1, 2, 1, 3], a[2, 3, 2, 1], a[3, 0, 0, 2] = -0.0, float("nan"), float("inf"), -0.0
    b = torch.randn(5, 7, 1, 6, generator=g).relu().to(torch.bfloat16)
    c = torch.tensor([0.0, 1.0, 0.0, 2.0]).expand(5, 7, 2, 4)  # a static profile, expanded to a batch
    d = torch.randn(5, 4, 7, 3, generator=g).relu().permute(0, 2, 3, 1)  # strided
    want = lambda t: np.count_nonzero(t.float().numpy().reshape(t.shape[0], -1), 1) / (t.shape[1] * t.shape[2])
    coeffs = [a, b, c, d]
    gates = Description(("vector_gate",) * 4)
    assert torch.equal(gates.active(coeffs), torch.from_numpy(np.mean([want(t) for t in coeffs], 0)))
    routers = Description(("vector_gate", "expert_router", "vector_gate", "expert_router"))  # routers are counted
    assert torch.equal(routers.active(coeffs), torch.from_numpy((want(b) + want(d)) / 2))
    signed = torch.full((1, 2, 1, 3), -0.0)
    signed[0, 1, 0, 2] = float("nan")
    assert Description(("vector_gate",)).active([signed]).tolist() == [0.5]
