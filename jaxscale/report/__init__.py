"""Reporting: figures and the markdown report of a sweep (`python -m jaxscale.report <results dir>`).

The notebook (experiments/compare_sweeps.ipynb) and the report call the same functions, re-exported here.
"""

from jaxscale.report.markdown import (
    figures,
    main,
    notes,
    plot_input_wait,
    plot_memory_breakdown,
    plot_op_shares,
    plot_time_vs_memory,
    plot_tokens_per_s,
    plot_vs_baseline,
    reads_input,
    summary_table,
    to_markdown,
    variant_labels,
    write_report,
)
from jaxscale.report.predicted import is_plan

__all__ = [
    "figures", "is_plan", "main", "notes", "plot_input_wait", "plot_memory_breakdown", "plot_op_shares",
    "plot_time_vs_memory", "plot_tokens_per_s", "plot_vs_baseline", "reads_input", "summary_table", "to_markdown",
    "variant_labels", "write_report",
]  # fmt: skip
