"""The family registry: controller_for finds a registered family's sites, and a registration can be undone."""

import pytest

from fcaudit.controllers import Controller
from fcaudit.errors import FcauditError
from fcaudit.families import Family, controller_for, register
from fcaudit.models.featuregate import FeatureGateGPT, config_for
from conftest import ToyMoE


def test_controller_for_registry_and_featuregate():
    with pytest.raises(FcauditError, match="Controller.from_modules"):
        controller_for(ToyMoE())
    sites = lambda m: Controller.from_modules(m, "layers.*.router", "(batch token) expert")  # noqa: E731
    unregister = register(Family("toy-moe", matches=lambda m: isinstance(m, ToyMoE), controller=sites))
    try:
        assert [s.path for s in controller_for(ToyMoE()).sites] == ["layers.0.router", "layers.1.router"]
    finally:
        unregister()
    with pytest.raises(FcauditError, match="Controller.from_modules"):  # the registration did not leak
        controller_for(ToyMoE())
    model = FeatureGateGPT(config_for("tiny", "featuregate"))
    ctrl = controller_for(model)
    assert [s.path for s in ctrl.sites] == ["blocks.0.gate", "blocks.1.gate"]
    assert ctrl.labels == {"StaticProfile": "LayerMean", "StructureRemoved": "GlobalMean"}
    with pytest.raises(FcauditError, match="no gate modules"):
        controller_for(FeatureGateGPT(config_for("tiny", "dense")))
