"""The run summary's measurement lines: a utilization above 100% is called out, never shown as if it could be."""

from jaxscale.measure import columns


def _row(mfu: float, hfu: float, backend: str = "cpu") -> dict:
    return {"mfu": mfu, "hfu": hfu, "backend": backend, "peak_flops_source": "measured: a jitted matmul"}


def test_a_utilization_above_100_percent_says_the_peak_is_stale():
    """Seen on this machine: MFU 169.5% against a roofline cached while other jobs loaded the cores; the summary
    says the step beat the cached peak and how to measure it again."""
    lines = columns.summary_lines(_row(1.695, 2.005))
    assert lines[0].startswith("  MFU 169.5%  HFU 200.5%")
    assert lines[1].startswith("  utilization above 100%: this step ran faster than the cached roofline")
    assert "python -m jaxscale.bench" in lines[1]
    gpu = columns.summary_lines(_row(0.9, 1.2, "gpu"))  # HFU alone above: the datasheet peak is wrong for it
    assert gpu[1] == "  utilization above 100%: this step ran faster than the peak it is divided by; that peak is wrong"


def test_a_utilization_under_100_percent_adds_nothing():
    assert columns.summary_lines(_row(0.42, 0.55)) == ["  MFU 42.0%  HFU 55.0%  (peak: measured: a jitted matmul)"]


def test_a_mixture_of_experts_says_its_dispatch_and_where_its_balance_is_counted():
    """The summary names the dispatch a preset gave (scatter by default), its capacity factor where tokens can drop,
    and the load balance's scope; a dense model has no such line, nor a model without the balance loss its scope."""
    row = {"config.model.num_experts": 4, "config.model.moe_dispatch": "scatter",
           "config.model.moe_capacity_factor": 1.25, "config.model.moe_aux_loss_weight": 0.01,
           "config.model.moe_balance_scope": "minibatch"}  # fmt: skip
    assert columns.moe_line(row) == (
        "  mixture of experts: scatter dispatch (capacity's slots by index; capacity factor 1.25, choices past it "
        "dropped); load balance over each minibatch's rows on every device"
    )
    ragged = {**row, "config.model.moe_dispatch": "ragged", "config.model.moe_aux_loss_weight": 0.0}
    assert columns.moe_line(ragged) == ("  mixture of experts: ragged dispatch (dropless jax.lax.ragged_dot, which XLA "
                                        "expands over every expert on a GPU)")  # fmt: skip
    assert columns.moe_line({"config.model.num_experts": 0}) is None
    assert columns.summary_lines({**row, "config.model.moe_balance_scope": "device"})[0].endswith("each device's rows")


def test_the_per_parameter_line_divides_the_analytic_bytes_by_the_trained_parameters():
    row = {"params": 1000, "trainable_params": 1000, "analytic_params_bytes": 2000, "analytic_grads_bytes": 60,
           "analytic_optimizer_bytes": 2004, "config.optimizer.in_backward": True}  # fmt: skip
    assert columns.per_parameter_line(row) == (
        "  per parameter (analytic): weights 2.00 B, gradients 0.06 B (one layer's at a time: each updated inside the "
        "backward pass), optimizer state 2.00 B"
    )
    plain = {**row, "analytic_grads_bytes": 2000, "config.optimizer.in_backward": False}
    assert columns.per_parameter_line(plain) == (
        "  per parameter (analytic): weights 2.00 B, gradients 2.00 B, optimizer state 2.00 B"
    )
    assert columns.per_parameter_line({**row, "trainable_params": 10}) is None  # frozen parameters: not this line
