"""The fit planner's kept plans: each probe's compiled plan, stored once and judged again against any budget."""

from __future__ import annotations

import hashlib
import json
import pathlib
from typing import Any, Protocol

import ml_collections

from jaxscale.plan import fit_search


class ProbeStore(Protocol):
    """Where the plans are kept: a results directory (jaxscale.sweep.results.ResultsFile is one)."""

    directory: pathlib.Path

    def rows(self) -> list[dict]: ...

    def record(self, row: dict) -> None: ...


def plain(value: Any) -> Any:
    """A JSON value for what json cannot write: a NumPy scalar as its number (a byte count stays a number),
    anything else as its text."""
    return value.item() if hasattr(value, "item") and getattr(value, "ndim", None) == 0 else str(value)


def question_tag(question: str) -> str:
    """A short, stable name of a probe question (its text's hash)."""
    return hashlib.sha256(question.encode()).hexdigest()[:12]


def probe_key(variant: str) -> str:
    """A stored probe's `choice@minibatch`, with or without its question's tag."""
    return variant.rsplit("/", 1)[-1]


class ProbeCache:
    """Compiled plans of earlier fits (probes/results.jsonl) for the same config, target and GEMM modes.

    A plan does not depend on the budget, so a fit for another --memory or --headroom reuses them; each is
    judged against the current budget again.
    """

    def __init__(self, store: ProbeStore, question: str, fresh: bool = False):
        self.store, self.question, self.reused = store, question, 0
        store.directory.mkdir(parents=True, exist_ok=True)
        # --rerun compiles every probe again: a plan kept from an older lab may be of another program (the
        # question names the config and the target, not the code that compiled them).
        rows = [] if fresh else store.rows()
        self.known = {probe_key(r["variant"]): r for r in rows if r.get("fit_plan_question") == question}
        # A store keeps one row per variant: the probes of different questions (another --finetune method or
        # --precision of the same fit) are told apart by their question's tag, so none replaces another's.
        self.tag = question_tag(question)

    def measure(
        self,
        plan: fit_search.Planner,
        config: ml_collections.ConfigDict,
        choice: str,
        usable: int,
        minibatch: int,
        respect_xla_limit: bool = True,
    ) -> fit_search.Probe:
        """The probe of `choice` at `minibatch` against `usable` bytes: a kept plan where one decides, else compiled
        (and kept)."""
        key = f"{choice}@{minibatch}"
        entry = self.known.get(key)
        if entry is not None:
            kept_plan = (entry["plan"], entry["error"], entry["seconds"])
            kept = fit_search.judge(minibatch, *kept_plan, usable, respect_xla_limit)
            # A partial plan (Triton skipped: the cuBLAS plan did not fit the budget it was made for) decides
            # only "does not fit"; where this budget would let it fit, both GEMM modes are compiled.
            if not (entry["plan"] or {}).get("plan_gemm_partial") or not kept.fits:
                self.reused += 1
                return kept
        row, error, seconds = fit_search.plan_row(plan, config, choice, minibatch)
        entry = {"variant": f"{self.tag}/{key}", "status": "error" if error else "ok", "error": error, "plan": row}
        entry.update(seconds=seconds, fit_plan_question=self.question)
        entry = json.loads(json.dumps(entry, default=plain))
        self.store.record(entry)
        self.known[key] = entry
        return fit_search.judge(minibatch, entry["plan"], entry["error"], entry["seconds"], usable, respect_xla_limit)
