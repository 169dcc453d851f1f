"""Early exit: the decisions enter only through blocks.*.exit, the model obeys them (monotone, state copied upward),
replay imposes them without running the rule, and the family trains and loads."""

import pytest
import torch
from conftest import tiny_early_exit

import fcaudit as fca
from fcaudit.errors import FcauditError
from fcaudit.loss import token_nll
from fcaudit.models.early_exit import EarlyExitConfig


@pytest.fixture
def ids():
    return torch.randint(0, 256, (3, 24), generator=torch.Generator().manual_seed(2))


def exit_sites(model):
    return fca.Controller.from_modules(model, "blocks.*.exit", layout="batch token")


def test_tokens_leave_at_every_depth_and_a_block_runs_for_the_tokens_still_in(ids):
    model = tiny_early_exit()
    ctrl = exit_sites(model)
    with torch.inference_mode(), ctrl.capture(*ids.shape) as found:
        _, ran = model(ids, return_executed=True)
    decisions = torch.stack([c[:, :, 0, 0] for c in found])  # [2, B, T]: exit after block 0, after block 1
    assert decisions.dtype == torch.bool and [site.name for site in ctrl.sites] == ["blocks.0.exit", "blocks.1.exit"]
    assert ran[0].all()  # every token runs the first block
    assert torch.equal(ran[1], ~decisions[0]) and torch.equal(ran[2], ~(decisions[0] | decisions[1]))
    depth = ran.sum(0)
    assert set(depth.unique().tolist()) == {1, 2, 3}, "the spread classifiers should exit tokens at every depth"


def test_replay_imposes_the_decisions_without_running_the_exit_rule(ids):
    model = tiny_early_exit()
    ctrl = exit_sites(model)
    with torch.inference_mode(), ctrl.capture(*ids.shape) as found:
        live = model(ids)
    calls = []
    hooks = [b.exit.score.register_forward_hook(lambda *a: calls.append(1)) for b in model.blocks[:-1]]
    with torch.inference_mode(), ctrl.replay(found):
        replayed = model(ids)
    for h in hooks:
        h.remove()
    assert torch.equal(live, replayed) and not calls  # bit-equal logits, and no classifier ran


def test_a_non_monotone_mask_is_obeyed_as_exit_at_its_first_true(ids):
    model = tiny_early_exit(threshold=1.0)  # the live rule exits nothing
    with torch.inference_mode():
        full = model(ids)
    B, T = ids.shape
    first = torch.zeros(B, T, 1, 1, dtype=torch.bool)
    first[:, ::2] = True  # even positions exit after block 0
    second = ~first  # ... and "re-enter" at block 1: ignored, they have left; odd positions exit there
    ctrl = exit_sites(model)
    with torch.inference_mode(), ctrl.capture(B, T) as found:  # replay decodes into the outputs' captured form
        model(ids)
    with torch.inference_mode(), ctrl.replay([first, second], found.decoding):
        logits, ran = model(ids, return_executed=True)
    assert ran[1].tolist() == (~first[:, :, 0, 0]).tolist() and not ran[2].any()
    assert not torch.equal(logits, full)
    with torch.inference_mode():  # an exited token keeps its state: the even positions read the head after block 0
        h0 = model.blocks[0](model.embed(ids), torch.zeros(B, T, dtype=torch.bool))
        assert torch.equal(logits[:, ::2], model.lm_head(model.ln_f(h0))[:, ::2])


def test_the_forward_is_deterministic_and_the_loss_trains_the_exits_on_detached_states(ids):
    model = tiny_early_exit()
    with torch.inference_mode():
        assert torch.equal(model(ids), model(ids))
    model.train()
    loss = model.loss(ids)
    loss.backward()
    assert torch.isfinite(loss) and model.blocks[0].exit.score.weight.grad.abs().sum() > 0
    # the exit BCE does not reach the blocks: a loss without the classifiers' part gives the blocks the same gradient
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None and ".exit." not in n}
    model.zero_grad()
    h, nll = model.embed(ids), []
    for block in model.blocks:
        h = h + block.update(h)[0]
        nll.append(token_nll(model.lm_head(model.ln_f(h)), ids).mean())
    w = torch.arange(1.0, len(nll) + 1)
    ((torch.stack(nll) * w).sum() / w.sum()).backward()
    for n, g in grads.items():
        torch.testing.assert_close(model.get_parameter(n).grad, g, msg=n)


def test_a_bad_exit_threshold_is_one_line():
    with pytest.raises(FcauditError, match="exit_threshold"):
        EarlyExitConfig(exit_threshold=1.5)


def test_the_family_trains_saves_loads_and_its_controller_is_the_exit_depth(tmp_path):
    from fcaudit.train import TrainConfig, train

    result = train(TrainConfig(model="early-exit", preset="tiny", steps=4, eval_interval=4, batch_size=4,
                               eval_windows=2, test_windows=2, out=str(tmp_path / "r"), progress=False))
    model = fca.load(tmp_path / "r")
    assert type(model).__name__ == "EarlyExitGPT" and model.fcaudit_meta["variant"] == "early-exit"
    assert 0 < result.gate_mass <= 1  # the fraction of (block, token) pairs that ran on the test windows
    ctrl = fca.controller_for(model)
    assert [s.name for s in ctrl.sites] == ["blocks.0.exit"] and ctrl.info.lead.name == "exit_depth"
