"""Budgets observed, not assumed: with `runs=` naming each token router's routed block, the audit counts the tokens
that entered it on the first batch of every condition and refuses a model that re-derives its set (a threshold from
the replayed top-k value on its live router weights), while a block that gathers the chosen index passes."""

import torch
from harness import api_refusal
from torch import nn

import fcaudit as fca

V, D, T, K = 32, 16, 16, 4


class TopK(nn.Module):
    """The router as the site: live weights in, (scores, the chosen positions ascending) out."""

    def forward(self, w):
        return w, w.topk(K, dim=1).indices.sort(1).values


class Gathered(nn.Module):
    """Mixture-of-Depths: the block runs on the chosen tokens, gathered by their index, scaled by their score."""

    def __init__(self):
        super().__init__()
        self.score, self.router = nn.Linear(D, 1), TopK()
        self.block = nn.Sequential(nn.Linear(D, 2 * D), nn.GELU(), nn.Linear(2 * D, D))

    def forward(self, x):
        scores, index = self.router(self.score(x)[..., 0])
        at = index[..., None].expand(-1, -1, D)
        out = self.block(x.gather(1, at)) * torch.sigmoid(scores.gather(1, index))[..., None]
        return x.scatter_add(1, at, out)


class Thresholded(Gathered):
    """The same block, run on the tokens whose live weight reaches the k-th largest replayed top-k value."""

    def forward(self, x):
        w = self.score(x)[..., 0]
        scores, index = self.router(w)
        selected = w >= scores.gather(1, index).min(1, keepdim=True).values
        out = x.clone()
        out[selected] = x[selected] + self.block(x[selected]) * torch.sigmoid(w[selected])[:, None]
        return out


class LM(nn.Module):
    def __init__(self, layer):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.head = nn.Embedding(V, D), nn.Linear(D, V)
        self.layers = nn.ModuleList(layer() for _ in range(2))

    def forward(self, ids):
        h = self.emb(ids)
        for layer in self.layers:
            h = layer(h + h.cumsum(1) / torch.arange(1, ids.shape[1] + 1)[None, :, None])
        return self.head(h)


def windows(n, seed):
    return torch.randint(0, V, (n, T), generator=torch.Generator().manual_seed(seed))


def controller(model):
    return fca.Controller.from_modules(model, "layers.*.router", kind="token_router", runs="layers.*.block")


def test_a_router_whose_block_gathers_the_chosen_tokens_passes_the_budget_observation(tmp_path):
    model = LM(Gathered).eval()
    result = fca.audit(model, controller(model), windows(8, 0), windows(8, 1), randomizations=2, out=tmp_path / "a",
                       batch_size=4, quiet=True)
    assert result.replay.bit_equal and "RandomRoute" in result.penalties()


def test_a_router_that_rederives_its_set_from_a_threshold_is_refused_with_the_counts(tmp_path):
    model = LM(Thresholded).eval()
    line = api_refusal(lambda: fca.audit(model, controller(model), windows(8, 0), windows(8, 1), randomizations=2,
                                         out=tmp_path / "a", batch_size=4, quiet=True))
    assert "its routed block 'layers.0.block' did not run the tokens the replayed decisions chose" in line
    assert "the first batch sent" in line and "for 16 chosen" in line


def test_runs_must_name_one_block_per_token_router(tmp_path):
    model = LM(Gathered)
    assert "matches 6 modules for 2 sites" in api_refusal(lambda: fca.Controller.from_modules(
        model, "layers.*.router", kind="token_router", runs="layers.*.block.*"))
    assert "a depth controller's blocks); its sites are scalar_gates" in api_refusal(lambda: fca.Controller.from_modules(
        model, "layers.*.score", layout="batch token 1", runs="layers.*.block"))


def test_without_runs_the_routed_block_found_by_structure_is_named_in_a_notice(tmp_path):
    for layer in (Gathered, Thresholded):  # at Correct the threshold picks the chosen set: found, then refused
        model = LM(layer).eval()
        ctrl = fca.Controller.from_modules(model, "layers.*.router", kind="token_router")
        result = fca.audit(model, ctrl, windows(8, 0), windows(8, 1), randomizations=2,
                           out=tmp_path / layer.__name__, batch_size=4, quiet=True)
        assert any("entered 'layers.0.block' (found by structure: the rows it took) (2 sites): pass "
                   "runs='layers.*.block'" in n for n in result.replay.notices), result.replay.notices
