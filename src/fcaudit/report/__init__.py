"""Tables, figures and the Markdown/HTML report (paper Tables 1-2, Figures 2-5)."""

from fcaudit.report.render import build_report, discover
from fcaudit.report.tables import training_table

__all__ = ["build_report", "discover", "training_table"]
