"""What a whole training costs: device-hours, wall-clock days and dollars for a token budget at a row's speed.

A row's speed is its measured tokens/s where it ran (`tokens_per_s`), else its prediction
(`predicted_tokens_per_s`, for the planned GPUs); the columns say which (`cost_basis`). Both are the speed of
the whole step over all of the row's devices, so

    wall seconds = train_tokens / tokens_per_s,   device-hours = devices x wall seconds / 3600,
    dollars = device-hours x price per device-hour.

Nothing else is counted: no restarts, evaluation, checkpoint writes, data stalls or idle devices (what a
published figure such as Meta's GPU-hours for Llama 3.1 includes beside the steps; docs/published.md).
"""

from __future__ import annotations

SECONDS_PER_HOUR = 3600.0
SECONDS_PER_DAY = 86400.0


def row_devices(row: dict) -> int:
    """Devices a row's step runs on: the planned GPUs (plan_devices), else the mesh's devices, else one."""
    for key in ("plan_devices", "mesh_devices"):
        if row.get(key):
            return int(row[key])
    return 1


def training_cost(tokens_per_s: float, devices: int, train_tokens: float, hour_usd: float | None) -> dict:
    """Device-hours, wall-clock days and (with a price) dollars to train `train_tokens` at `tokens_per_s`.

    Raises:
      ValueError: a speed, device count or token budget that is not positive, or a negative price.
    """
    if not tokens_per_s > 0 or devices < 1 or not train_tokens > 0:
        raise ValueError(f"training_cost: tokens/s {tokens_per_s}, devices {devices} and tokens {train_tokens} "
                         "must be positive")  # fmt: skip
    if hour_usd is not None and hour_usd < 0:
        raise ValueError(f"training_cost: price per device-hour {hour_usd} must not be negative")
    seconds = train_tokens / tokens_per_s
    device_hours = devices * seconds / SECONDS_PER_HOUR
    return {
        "cost_device_hours": device_hours,
        "cost_wall_days": seconds / SECONDS_PER_DAY,
        "cost_usd": None if hour_usd is None else device_hours * hour_usd,
    }


def cost_columns(row: dict, train_tokens: float | None, hour_usd: float | None) -> dict:
    """The cost columns of a result row for a token budget (none without one): measured speed where the row
    ran, else predicted; all None (with the reason in cost_basis) when the row has neither."""
    if train_tokens is None:
        return {}
    columns = {"cost_train_tokens": train_tokens, "cost_device_hour_usd": hour_usd, "cost_devices": row_devices(row)}
    if row.get("tokens_per_s"):
        speed, basis = row["tokens_per_s"], "measured tokens/s"
    elif row.get("predicted_tokens_per_s"):
        speed, basis = row["predicted_tokens_per_s"], "predicted tokens/s"
    else:
        columns.update(cost_basis="no speed: neither measured nor predicted", cost_device_hours=None,
                       cost_wall_days=None, cost_usd=None)  # fmt: skip
        return columns
    columns["cost_basis"] = basis
    columns.update(training_cost(speed, columns["cost_devices"], train_tokens, hour_usd))
    return columns


def cost_text(row: dict) -> str | None:
    """One line for a run's summary, or None without cost columns."""
    if "cost_train_tokens" not in row:
        return None
    if row.get("cost_device_hours") is None:
        return f"training cost of {row['cost_train_tokens']:.3g} tokens: unknown ({row['cost_basis']})"
    price = "" if row.get("cost_usd") is None else f", ${row['cost_usd']:,.0f}"
    hours, days = f"{row['cost_device_hours']:,.0f} device-hours", f"{row['cost_wall_days']:,.1f} days"
    where = f"on {row['cost_devices']} device(s){price} ({row['cost_basis']})"
    return f"training cost of {row['cost_train_tokens']:.3g} tokens: {hours}, {days} {where}"
