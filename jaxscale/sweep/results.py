"""A sweep's result rows on disk (append-only JSON lines, a CSV copy), read back as a table against a baseline."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import pathlib
import sys
from collections.abc import Iterator

import pandas as pd

from jaxscale.cli import UsageError

RESULTS_FILE = "results.jsonl"
CSV_FILE = "results.csv"

# Columns load_results always returns (None where a row lacks them), in this order, before the rest.
COLUMNS = (
    "sweep", "variant", "baseline", "status", "error", "params", "tokens_per_step",
    "mesh", "mesh_layout", "mesh_devices",
    "step_s_median", "step_s_p90", "tokens_per_s", "compile_s",
    "compiled_peak_bytes", "compiled_backend", "device_peak_bytes", "host_peak_rss_bytes",
    "compiled_collective_bytes", "compiled_collective_ring_bytes",
    "best_peak_bytes", "best_peak_source", "throughput_vs_baseline", "peak_vs_baseline",
    "variant_overrides", "process_wall_s", "run_dir", "trace_dir",
)  # fmt: skip


def _fsync_dir(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_rows(path: pathlib.Path) -> list[dict]:
    """The rows of a results.jsonl, one per variant (the last wins); an unreadable line is skipped with a note."""
    if not path.exists():
        return []
    rows: dict[str, dict] = {}
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            print(f"jaxscale: {path}:{number}: skipped a line that is not a JSON row", file=sys.stderr)
            continue
        key = row.get("variant") or row.get("name")
        rows.pop(key, None)  # keep the file order of the latest rows
        rows[key] = row
    return list(rows.values())


def _line(row: dict) -> bytes:
    return (json.dumps(row, default=str) + "\n").encode()


class ResultsFile:
    """results.jsonl of one sweep: every finished variant's row, flushed to disk as soon as it is known.

    A row is appended with one write, then flushed and fsynced, so a `kill -9` loses at most the row being
    written; such a torn last line is dropped when the file is opened again. Replacing a variant's row
    (a rerun) rewrites the file through a temporary file and an atomic rename. One sweep process at a
    time holds the directory's lock.
    """

    def __init__(self, directory: pathlib.Path):
        self.directory = pathlib.Path(directory)
        self.path = self.directory / RESULTS_FILE
        self.csv_path = self.directory / CSV_FILE

    @contextlib.contextmanager
    def locked(self) -> Iterator[ResultsFile]:
        """Holds an exclusive lock on the directory (released by the OS even after kill -9)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        with open(self.directory / ".lock", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise UsageError(f"another sweep is writing {self.directory} (its lock is held)") from None
            self._drop_torn_line()
            yield self

    def _drop_torn_line(self) -> None:
        if not self.path.exists():
            return
        data = self.path.read_bytes()
        if data and not data.endswith(b"\n"):
            keep = data.rfind(b"\n") + 1
            with open(self.path, "r+b") as f:
                f.truncate(keep)
                os.fsync(f.fileno())
            print(f"jaxscale: {self.path}: dropped an incomplete last line (a sweep was killed while writing it)")

    def rows(self) -> list[dict]:
        return read_rows(self.path)

    def record(self, row: dict) -> None:
        """Stores a variant's row durably: appended, or replacing that variant's earlier row."""
        rows = self.rows()
        if any(r.get("variant") == row["variant"] for r in rows):
            kept = [r for r in rows if r.get("variant") != row["variant"]]
            tmp = self.path.with_suffix(".jsonl.tmp")
            with open(tmp, "wb") as f:
                f.write(b"".join(_line(r) for r in [*kept, row]))
                f.flush()
                os.fsync(f.fileno())
            tmp.replace(self.path)
            _fsync_dir(self.directory)
        else:
            with open(self.path, "ab") as f:
                f.write(_line(row))
                f.flush()
                os.fsync(f.fileno())
        self.write_csv()

    def write_csv(self) -> None:
        """Regenerates results.csv (flat, the columns of load_results) from results.jsonl."""
        tmp = self.csv_path.with_suffix(".csv.tmp")
        load_results(self.path).to_csv(tmp, index=False)
        tmp.replace(self.csv_path)


def best_peak(row: dict) -> tuple[int | None, str | None]:
    """(bytes, source): the device allocator's peak where steps ran and it was measured, else XLA's compiled
    plan (named by backend). A plan-only row never offers a device peak, even an old row that carries one."""
    if row.get("device_peak_bytes") is not None and not row.get("plan_only"):
        return row["device_peak_bytes"], "device"
    if row.get("compiled_peak_bytes") is not None:
        return row["compiled_peak_bytes"], f"compiled plan ({row.get('compiled_backend') or 'unknown backend'})"
    return None, None


def _ratio(value: float | None, reference: float | None) -> float | None:
    if value is None or reference is None or reference == 0 or pd.isna(value) or pd.isna(reference):
        return None
    return float(value) / float(reference)


def compare_to_baseline(rows: list[dict]) -> list[dict]:
    """Adds best_peak_* and the ratios against each row's baseline variant (an ok row of the same sweep).

    throughput_vs_baseline = tokens_per_s / baseline tokens_per_s (>1 is faster; the same as the ratio of
    step times where tokens per step are equal). peak_vs_baseline = best_peak_bytes / baseline's, only when
    both come from the same source (never a device peak against a compiled plan).
    """
    ok = {(r.get("sweep"), r.get("variant")): r for r in rows if r.get("status") == "ok"}
    out = []
    for row in rows:
        row = dict(row)
        row["best_peak_bytes"], row["best_peak_source"] = best_peak(row)
        base = ok.get((row.get("sweep"), row.get("baseline")))
        base_peak, base_source = best_peak(base) if base else (None, None)
        speed = _ratio(row.get("tokens_per_s"), base and base.get("tokens_per_s"))
        row["throughput_vs_baseline"] = speed if row.get("status") == "ok" else None
        same = base_source is not None and base_source == row["best_peak_source"]
        row["peak_vs_baseline"] = _ratio(row["best_peak_bytes"], base_peak) if same else None
        out.append(row)
    return out


def load_results(path: str | os.PathLike) -> pd.DataFrame:
    """A sweep's rows as a DataFrame: one row per variant, the COLUMNS first, then every other row field.

    Args:
      path: a results.jsonl, or the sweep's results directory holding one.

    Returns:
      DataFrame with COLUMNS (None where unknown) and the flat result-row fields (`config.*`, `compiled_*`, ...).
    """
    path = pathlib.Path(path)
    if path.is_dir():
        path = path / RESULTS_FILE
    if not path.exists():
        raise FileNotFoundError(f"no sweep results at {path}")
    frame = pd.DataFrame(compare_to_baseline(read_rows(path)))
    for column in COLUMNS:
        if column not in frame:
            frame[column] = None
    return frame[[*COLUMNS, *(c for c in frame.columns if c not in COLUMNS)]]


GIB = 2**30


def _cell(value: float | None, spec: str) -> str:
    return "-" if value is None or pd.isna(value) else format(value, spec)


def _gib(value: float | None, decimals: int = 3) -> str:
    return "-" if value is None or pd.isna(value) else f"{value / GIB:.{decimals}f}"


def _versus(row: dict) -> str:
    if row.get("variant") == row.get("baseline"):
        return "baseline"
    parts = []
    speed = row["throughput_vs_baseline"]
    if speed is not None:
        parts.append(f"{speed:.2f}x faster" if speed >= 1 else f"{1 / speed:.2f}x slower")
    if row["peak_vs_baseline"] is not None:
        parts.append(f"{row['peak_vs_baseline']:.2f}x memory")
    return ", ".join(parts) or "-"


def _fits(row: dict) -> str:
    return {True: "yes", False: "NO"}.get(row.get("plan_fits"), "-")


def _mib(value: float | None) -> str:
    return "-" if value is None or pd.isna(value) else f"{value / 2**20:.2f}"


_LAYOUT_KINDS = ("all_reduce", "all_gather", "reduce_scatter")  # the collective kinds a layout is made of


def _collectives_by_kind(row: dict) -> str:
    """MiB per device per step of all-reduce / all-gather / reduce-scatter."""
    return " / ".join(_mib(row.get(f"compiled_collective_{kind}_bytes")) for kind in _LAYOUT_KINDS)


def _f32_shares(row: dict) -> str:
    """The float32 share of the all-reduce / all-gather / reduce-scatter bytes ("-" for a kind with none)."""
    cells = []
    for kind in _LAYOUT_KINDS:
        total, f32 = row.get(f"compiled_collective_{kind}_bytes"), row.get(f"compiled_collective_{kind}_f32_bytes")
        cells.append("-" if not total or f32 is None or pd.isna(total) or pd.isna(f32) else f"{f32 / total:.0%}")
    return " / ".join(cells)


def mesh_of(row: dict) -> str:
    """The row's mesh as data x fsdp x tensor (from its config where the run left no mesh column)."""
    if row.get("mesh"):
        return row["mesh"]
    return "x".join(str(row.get(f"config.mesh.{axis}") or 1) for axis in ("data", "fsdp", "tensor"))


def _is_mesh(row: dict) -> bool:
    return mesh_of(row) != "1x1x1"


def _band(row: dict) -> str:
    triton, cublas = row.get("compiled_triton_peak_bytes"), row.get("compiled_cublas_peak_bytes")
    return "-" if triton is None and cublas is None else f"{_gib(triton)} / {_gib(cublas)}"


# (header, cell, shown when): columns of the printed table; a column is shown when any row has its field.
_TABLE_COLUMNS = (
    ("status", lambda r: r.get("status"), None),
    ("mesh", mesh_of, "mesh"),
    ("step s (median)", lambda r: _cell(r.get("step_s_median"), ".4f"), "ran"),
    ("tokens/s", lambda r: _cell(r.get("tokens_per_s"), ",.0f"), "ran"),
    ("input wait s", lambda r: _cell(r.get("input_wait_s_median"), ".4f"), "text"),
    ("step+wait s", lambda r: _cell(r.get("step_with_input_wait_s_median"), ".4f"), "text"),
    ("compile s", lambda r: _cell(r.get("compile_s"), ".1f"), None),
    ("peak GiB", lambda r: _gib(r["best_peak_bytes"]), None),
    ("peak source", lambda r: r["best_peak_source"] or "-", None),
    ("analytic GiB", lambda r: _gib(r.get("analytic_peak_bytes")), "analytic_peak_bytes"),
    ("MFU", lambda r: _cell(r.get("mfu"), ".1%"), "mfu"),
    ("collective MiB", lambda r: _mib(r.get("compiled_collective_bytes")), "collectives"),
    ("AR / AG / RS MiB", _collectives_by_kind, "collectives"),
    ("AR / AG / RS f32", _f32_shares, "collectives"),
    ("ring MiB", lambda r: _mib(r.get("compiled_collective_ring_bytes")), "collectives"),
    ("trace DUS", lambda r: _cell(r.get("trace_dus_share"), ".1%"), "trace_dus_share"),
    ("triton / cublas GiB", _band, "plan_target"),
    ("fits", _fits, "plan_target"),
    ("notebook GiB", lambda r: _gib(r.get("notebook_peak_bytes"), 1), "notebook_peak_bytes"),
    ("plan / notebook", lambda r: _cell(r.get("planned_over_notebook"), ".2f"), "notebook_peak_bytes"),
    ("predicted s", lambda r: _cell(r.get("predicted_step_s"), ".4f"), "predicted_step_s"),
    ("pred / meas", lambda r: _cell(r.get("predicted_over_measured"), ".2f"), "predicted_over_measured"),
    ("pred MFU", lambda r: _cell(r.get("predicted_mfu"), ".1%"), "predicted_mfu"),
    ("notebook s", lambda r: _cell(r.get("notebook_step_s"), ".2f"), "notebook_step_s"),
    ("pred / notebook", lambda r: _cell(r.get("predicted_over_notebook"), ".2f"), "notebook_step_s"),
)


def _shown(rows: list[dict], when: str | None) -> bool:
    if when is None:
        return True
    if when == "ran":  # step columns: hidden only for a sweep of plans (--plan), where no step runs
        return not all(r.get("plan_only") for r in rows) or any(r.get("step_s_median") is not None for r in rows)
    if when == "mesh":  # only where some variant runs on a mesh
        return any(_is_mesh(r) for r in rows)
    if when == "collectives":
        return any(r.get("compiled_collective_bytes") for r in rows)
    if when == "text":  # input-pipeline columns: shown when some variant trains on text
        return any(r.get("config.data.source") == "text" for r in rows)
    return any(r.get(when) is not None for r in rows)


def _notes(rows: list[dict]) -> list[str]:
    """One line per failed variant (its error) and per planned variant that does not fit its target."""
    notes = []
    for r in rows:
        if r.get("status") != "ok":
            notes.append(f"  {r.get('variant')}: {r.get('status')}: {r.get('error')}")
        elif r.get("plan_fits") is False:
            if r.get("compiled_remat_limit_bytes") is not None:
                why = (f"XLA's rematerialization reached {_gib(r['compiled_remat_reached_bytes'], 2)} GiB, above "
                       f"its limit of {_gib(r['compiled_remat_limit_bytes'], 2)} GiB")  # fmt: skip
            else:
                why = r.get("plan_fits_reason")
            notes.append(f"  {r.get('variant')}: does NOT fit on {r.get('plan_target')}: {why}")
    return notes


def format_table(rows: list[dict], order: list[str] | None = None) -> str:
    """The sweep as a text table, one line per variant, against the baseline variant.

    Columns: status, the mesh (data x fsdp x tensor, where any variant has one), step time and tokens/s (not
    for a sweep of plans), the median input wait and step + wait (when a variant trains on text), compile
    time, peak memory with its source (per device on a mesh), the analytic peak estimate, MFU, the
    collectives' MiB per device and step (all of them, all-reduce / all-gather / reduce-scatter, and what a
    ring sends) and the trace's dynamic-update-slice share where rows have
    them, and for GPU-target plans the Triton / cuBLAS band and whether it fits, and where the sweep file
    gives them the notebook's measured peak and planned / notebook; the predicted step time beside the
    measured one (pred / meas) or the notebook's (pred / notebook); the change against the baseline last.
    Failures' errors and plans that do not fit are explained beneath.
    """
    rows = compare_to_baseline(rows)
    rank = {name: i for i, name in enumerate(order or [])}
    rows.sort(key=lambda r: rank.get(r.get("variant"), len(rank)))
    baseline = next((r.get("baseline") for r in rows if r.get("baseline")), None)
    columns = [(header, cell) for header, cell, when in _TABLE_COLUMNS if _shown(rows, when)]
    lines = [("variant", *(header for header, _ in columns), f"vs {baseline}")]
    for r in rows:
        lines.append((r.get("variant") or r.get("name"), *(cell(r) for _, cell in columns), _versus(r)))
    lines = [tuple(str(cell) for cell in line) for line in lines]
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    text = ["  ".join(cell.ljust(width) for cell, width in zip(line, widths, strict=True)).rstrip() for line in lines]
    if any(_is_mesh(r) for r in rows):
        text.append("  memory and collective MiB are per device; collectives per optimizer step (compiled HLO)")
    return "\n".join(text + _notes(rows))
