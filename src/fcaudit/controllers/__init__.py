"""Controller adapters: which modules emit a model's coefficients, and how to read them (site codecs).

A model's own adapter is found by its family (fcaudit.families.controller_for); any other model is described with
`Controller.from_modules`.
"""

from fcaudit.controllers.routing import CapacityRoute
from fcaudit.controllers.site import Codec, Controller, Layout, Site, TokenRoute

__all__ = ["CapacityRoute", "Codec", "Controller", "Layout", "Site", "TokenRoute"]
