"""Controller adapters: which modules emit a model's coefficients, and how to read them (site codecs); a family's
own is `fcaudit.families.controller_for`."""

from fcaudit.controllers.codecs import Codec, Decisions, Layout, TokenRoute
from fcaudit.controllers.controller import Controller
from fcaudit.controllers.patching import Captured
from fcaudit.controllers.routing import CapacityRoute
from fcaudit.controllers.sites import Decoding, Site

__all__ = ["CapacityRoute", "Captured", "Codec", "Controller", "Decisions", "Decoding", "Layout", "Site", "TokenRoute"]
