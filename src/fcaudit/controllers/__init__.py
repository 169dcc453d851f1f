"""Controller adapters: which modules emit a model's coefficients, and how to read them (site codecs); a family's
own is `fcaudit.families.controller_for`."""

from fcaudit.controllers.routing import CapacityRoute
from fcaudit.controllers.site import Codec, Controller, Layout, Site, TokenRoute

__all__ = ["CapacityRoute", "Codec", "Controller", "Layout", "Site", "TokenRoute"]
