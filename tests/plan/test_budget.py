"""jaxscale.plan.budget: what a GPU target's runtime gives the program's buffers, and the setting it needs."""

from __future__ import annotations

import pytest

from jaxscale.plan import budget
from jaxscale.plan.gpu_plan import PlanFlagError

GIB = 2**30
A5000 = 24564 * 2**20  # CUDA's total for the A5000 (jaxscale/plan/targets.py): 23.988 GiB


def test_the_default_is_jaxs_75_percent_pool_and_needs_no_setting():
    got = budget.for_target("a5000", A5000, environ={})
    assert got.bytes == 19_317_915_648  # 24564 MiB x 3/4, by hand
    assert (got.mem_fraction, got.mem_fraction_source, got.run_env) == (0.75, "JAX's default", None)
    assert got.reserve_bytes == GIB and got.columns()["fit_budget_bytes"] == got.bytes


def test_a_fraction_set_here_or_by_flag_is_the_pool_and_the_answer_names_the_setting():
    from_env = budget.for_target("a5000", A5000, environ={"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.9"})
    assert from_env.bytes == int(0.9 * A5000) and from_env.run_env == "XLA_CLIENT_MEM_FRACTION=0.9"
    assert from_env.mem_fraction_source == "XLA_PYTHON_CLIENT_MEM_FRACTION in the environment"
    flag = budget.for_target("a5000", A5000, mem_fraction=0.8, environ={"XLA_CLIENT_MEM_FRACTION": "0.9"})
    assert flag.bytes == int(0.8 * A5000) and flag.run_env == "XLA_CLIENT_MEM_FRACTION=0.8"  # the flag wins


def test_memory_above_the_default_pool_raises_the_fraction_it_needs():
    got = budget.for_target("a5000", A5000, memory=20 * GIB, environ={})
    assert got.bytes == 20 * GIB and got.run_env == "XLA_CLIENT_MEM_FRACTION=0.84"  # 20 / 23.988 = 0.8338, up
    assert budget.for_target("a5000", A5000, memory=12 * GIB, environ={}).run_env is None  # within 75%


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"mem_fraction": 0.96}, "--mem_fraction: 0.96 of target a5000's 23.99 GiB leaves less than the 1 GiB kept"),
        ({"mem_fraction": 0.0}, "allowed: 0 < fraction <= 0.95"),  # 1 - 1 / 23.988 = 0.9583, down
        ({"memory": 23 * GIB}, "--memory 23 GiB: more than JAX's allocator can have on target a5000's 23.99 GiB"),
        ({"memory": 20 * GIB, "environ": {"XLA_CLIENT_MEM_FRACTION": "0.8"}}, "raise XLA_CLIENT_MEM_FRACTION"),
        ({"environ": {"XLA_CLIENT_MEM_FRACTION": "most"}}, "XLA_CLIENT_MEM_FRACTION: 'most' is not a fraction"),
    ],
)
def test_a_budget_the_runtime_cannot_give_is_one_line_naming_the_setting(kwargs, message):
    kwargs.setdefault("environ", {})
    with pytest.raises(PlanFlagError, match=message.replace("(", r"\(")) as error:
        budget.for_target("a5000", A5000, **kwargs)
    assert "\n" not in str(error.value)
