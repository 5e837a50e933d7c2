"""The planning errors, below every planning module: a failed target compile and an option that cannot be planned."""

from __future__ import annotations


class PlanError(RuntimeError):
    """The target compile failed (a crash, a signal or an XLA error); the message is one line."""


class PlanFlagError(ValueError):
    """A planning option that cannot be planned: --target, --gemm, --devices, or the mesh fields they need.

    The message is one line naming the flag or field and what is allowed; the front doors (jaxscale.run,
    jaxscale.sweep, jaxscale.fit) print it as their usage error (exit 2).
    """
