"""fcaudit: Frozen-Controller Auditing of dynamic neural networks."""

from fcaudit.errors import FcauditError

__version__ = "0.1.0"

__all__ = ["FcauditError", "__version__"]
