"""The dry-run plan: sizes, forward passes, conditions, and where the store is held."""

from fcaudit import plan
from fcaudit.auditor.state import STATE_CHECK_PASSES
from fcaudit.controllers import Controller
from fcaudit.controllers.checks import BATCH_CHECK_PASSES
from conftest import T, ToyMoE, windows


def test_plan_reports_sizes():
    model = ToyMoE()
    ctrl = Controller.from_modules(model, "layers.*.router", "(batch token) expert")
    p = plan(model, ctrl, windows(32, 0), windows(8, 1), batch_size=8, randomizations=20)
    assert p.layer_shapes == [[T, 1, 4], [T, 1, 4]]
    assert p.store_bytes == 32 * 2 * T * 4 * 4
    # the units, then the batch-composition check and the state check's repeated Correct pass
    assert p.forward_passes == 1 + 4 * (2 + 80 + 3) + BATCH_CHECK_PASSES + STATE_CHECK_PASSES
    assert p.conditions == ["Correct", "CrossInput", "TokenShuffle", "CrossShuffle", "TokenResamplePast",
                            "LayerPositionMean", "StaticProfile", "StructureRemoved"]  # a source mixture's
    assert p.activation_bytes > 0
    assert p.peak_memory_bytes > sum(x.numel() * 4 for x in model.parameters())
    assert p.store_device is None and "hold the store" not in str(p)  # the CPU reads the store from its files


def test_plan_names_the_device_that_holds_the_store(monkeypatch):
    """Where a GPU has room for the store (`keeps_store_on`, the engine's rule), the plan says it is held there; the
    rule's answer on a GPU stands in here, in the module that plans."""
    import sys

    asked = []
    monkeypatch.setattr(sys.modules[plan.__module__], "keeps_store_on",
                        lambda device, nbytes: asked.append(nbytes) or True)
    model = ToyMoE()
    p = plan(model, Controller.from_modules(model, "layers.*.router", "(batch token) expert"), windows(32, 0))
    assert asked == [p.store_bytes] and p.store_device == "cpu"
    assert str(p).endswith("per window); the replays also hold the store on cpu")
