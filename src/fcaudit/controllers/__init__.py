"""Controller adapters: which modules emit a model's coefficients, and in which layout."""

from fcaudit.controllers.site import Controller, Layout, Site
from fcaudit.controllers.generic import controller_for, register
from fcaudit.controllers import featuregate as _featuregate  # noqa: F401  (registers the built-in adapter)

__all__ = ["Controller", "Layout", "Site", "controller_for", "register"]
