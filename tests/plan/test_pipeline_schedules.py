"""Analytic pipeline schedules against independent derivations: a discrete-event simulation of each schedule's
per-rank order (GPipe, 1F1B, interleaved 1F1B), the paper's bubble-over-ideal ratios, a hand count, and the compiled
program's own Schedule.

The simulator knows nothing of the closed forms: it is given each rank's order of forwards and backwards and the
dependencies (a forward of microbatch j on virtual stage s after stage s - 1's forward of j; a backward of j on s after
stage s + 1's backward of j, the last stage's after its own forward of j), runs every op as early as its rank and its
dependency allow, and counts the span, each rank's activations held (forwards run whose backward has not) and the
point-to-point sends on each rank boundary.
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction

import pytest

from jaxscale.model.pipeline import Schedule
from jaxscale.plan.pipeline_schedules import AnalyticSchedule, table

Op = tuple[str, int, int]  # ("F" or "B", microbatch, chunk)


@dataclasses.dataclass
class Simulated:
    span: Fraction  # the step: the last op's end
    busy: Fraction  # each rank's compute time (the same on every rank)
    peak: list[int]  # per rank: the most units held at once
    sends: dict[int, int]  # hand-off b (virtual stage b to b + 1, either way) -> point-to-point sends over the step

    def boundary(self, rank: int) -> int:
        """Sends across rank -> rank + 1 (its chunks' hand-offs b with b mod p == rank), forward and backward."""
        p = len(self.peak)
        return sum(n for b, n in self.sends.items() if b % p == rank)

    @property
    def idle_fraction(self) -> Fraction:
        return (self.span - self.busy) / self.span


def simulate(orders: list[list[Op]], chunks: int, t_f: Fraction, t_b: Fraction) -> Simulated:
    """Every rank runs its ops in its order, each as soon as the rank is free and its dependency has finished."""
    p = len(orders)
    last = p * chunks - 1
    done: dict[tuple[str, int, int], Fraction] = {}  # (kind, virtual stage, microbatch) -> end time
    clock, nxt, held = [Fraction(0)] * p, [0] * p, [0] * p
    peak, sends = [0] * p, {}
    while any(nxt[r] < len(orders[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while nxt[r] < len(orders[r]):
                kind, j, c = orders[r][nxt[r]]
                s = c * p + r
                if kind == "F":
                    dep = ("F", s - 1, j) if s > 0 else None
                else:
                    dep = ("B", s + 1, j) if s < last else ("F", s, j)
                if dep is not None and dep not in done:
                    break
                if dep is not None and dep[1] % p != r:  # the input came from another rank: one send
                    key = min(s, dep[1])
                    sends[key] = sends.get(key, 0) + 1
                start = max(clock[r], done[dep] if dep else Fraction(0))
                clock[r] = start + (t_f if kind == "F" else t_b)
                done[(kind, s, j)] = clock[r]
                held[r] += 1 if kind == "F" else -1
                peak[r] = max(peak[r], held[r])
                nxt[r] += 1
                moved = True
        assert moved, "the orders deadlock"
    m_v = sum(1 for op in orders[0] if op[0] == "F")
    return Simulated(max(clock), m_v * (t_f + t_b), peak, sends)


def gpipe_orders(p: int, m: int) -> list[list[Op]]:
    """Every rank: all m forwards, then all m backwards."""
    return [[("F", j, 0) for j in range(m)] + [("B", j, 0) for j in range(m)] for _ in range(p)]


def one_f_one_b_orders(p: int, m: int) -> list[list[Op]]:
    """Rank r: p - r - 1 forwards (at most m), then one forward and one backward in turn, then the backwards left."""
    orders = []
    for r in range(p):
        warm = min(p - r - 1, m)
        ops = [("F", j, 0) for j in range(warm)]
        for j in range(m - warm):
            ops += [("F", warm + j, 0), ("B", j, 0)]
        ops += [("B", j, 0) for j in range(m - warm, m)]
        orders.append(ops)
    return orders


def interleaved_orders(p: int, m: int, v: int) -> list[list[Op]]:
    """Megatron-LM's interleaved 1F1B (megatron/core/pipeline_parallel/schedules.py, microbatch groups of p):
    forwards go through groups of p microbatches chunk by chunk (get_schedule_table), backwards the same with the
    chunks reversed; rank r runs 2·(p - r - 1) + (v - 1)·p forwards first (at most m·v), then one forward and one
    backward in turn, then the backwards left."""
    order = [(j, c) for g in range(0, m, p) for c in range(v) for j in range(g, min(g + p, m))]
    total = m * v
    orders = []
    for r in range(p):
        warm = min(2 * (p - r - 1) + (v - 1) * p, total)
        fwd = [("F", j, c) for j, c in order]
        bwd = [("B", j, v - 1 - c) for j, c in order]
        ops = fwd[:warm]
        for k in range(total - warm):
            ops += [fwd[warm + k], bwd[k]]
        ops += bwd[total - warm :]
        orders.append(ops)
    return orders


# (p, m): m < p, m == p, m > p, and p == 1
SHAPES = [(1, 3), (2, 1), (2, 2), (2, 5), (3, 2), (3, 3), (3, 7), (4, 1), (4, 3), (4, 4), (4, 8), (5, 11)]
# Both ratios give the closed form: with every stage alike the step is (m + p - 1)·(t_f + t_b) (the first
# microbatch's forward reaches the last stage after (p - 1)·t_f, the last backward leaves the first stage (p - 1)·t_b
# after the last stage's), so each rank idles (p - 1)·(t_f + t_b) over m·(t_f + t_b) busy and t_b/t_f cancels:
# t_b = t_f is the paper's unit picture, t_b = 2·t_f the usual cost of a backward.
TIMES = [(Fraction(1), Fraction(1)), (Fraction(1), Fraction(2))]


@pytest.mark.parametrize("t_f,t_b", TIMES)
@pytest.mark.parametrize("p,m", SHAPES)
def test_1f1b_equals_its_simulation(p, m, t_f, t_b):
    sim = simulate(one_f_one_b_orders(p, m), 1, t_f, t_b)
    s = AnalyticSchedule("1f1b", p, m)
    assert Fraction(s.bubble).limit_denominator(10**6) == sim.idle_fraction == Fraction(p - 1, m + p - 1)
    assert [s.in_flight(r) for r in range(p)] == sim.peak
    for r in range(p - 1):  # each boundary: an activation forward and a gradient back per microbatch
        assert sim.boundary(r) == s.permutes_per_microbatch * m
    assert sum(sim.sends.values()) == s.sends_per_microbatch * m


@pytest.mark.parametrize("t_f,t_b", TIMES)
@pytest.mark.parametrize("p,m", SHAPES)
def test_gpipe_holds_every_microbatch_on_every_rank(p, m, t_f, t_b):
    sim = simulate(gpipe_orders(p, m), 1, t_f, t_b)
    s = AnalyticSchedule("gpipe", p, m)
    assert sim.peak == [m] * p == [s.in_flight(r) for r in range(p)]
    assert Fraction(s.bubble).limit_denominator(10**6) == sim.idle_fraction
    assert s.bubble == AnalyticSchedule("1f1b", p, m).bubble == Schedule(p, m).bubble  # the compiled GPipe's


@pytest.mark.parametrize("t_f,t_b", TIMES)
@pytest.mark.parametrize("p,m,v", [(1, 3, 2), (2, 2, 2), (2, 4, 2), (2, 6, 3), (3, 3, 2), (3, 6, 2), (4, 8, 2),
                                   (4, 4, 3), (4, 12, 3)])  # fmt: skip
def test_interleaved_bubble_is_the_papers_and_its_peak_the_simulated_one(p, m, v, t_f, t_b):
    """A chunk takes t_f/v and t_b/v (a rank's v chunks are its L/p layers): the paper's bubble time over ideal
    time is (1/v)·(p - 1)/m (section 2.2.2), the idle share of the step b/(1 + b)."""
    sim = simulate(interleaved_orders(p, m, v), v, t_f / v, t_b / v)
    s = AnalyticSchedule("interleaved_1f1b", p, m, v)
    ratio = (sim.span - sim.busy) / sim.busy
    assert ratio == Fraction(p - 1, v * m)
    assert Fraction(s.bubble).limit_denominator(10**6) == sim.idle_fraction == ratio / (1 + ratio)
    assert s.bubble == Schedule(p, m, v).bubble  # the compiled circular program's
    assert [s.in_flight(r) for r in range(p)] == sim.peak
    if p > 1:
        for r in range(p - 1):
            assert sim.boundary(r) == s.permutes_per_microbatch * m
        assert sim.boundary(p - 1) == 2 * (v - 1) * m  # the last rank's chunk c hands to the first's chunk c + 1
    assert sum(sim.sends.values()) == s.sends_per_microbatch * m


def test_interleaved_by_hand_two_stages_two_chunks_four_microbatches():
    """p = 2, v = 2, m = 4, L = 8 layers: a chunk is 2 layers; "F2.1" is microbatch 2's forward through the rank's
    chunk 1. Megatron-LM's order (groups of p = 2 microbatches, chunk by chunk; backwards with the chunks reversed),
    with the units held after each op:

      rank 0, warmup 2·(2 - 0 - 1) + (2 - 1)·2 = 4:
        F0.0 F1.0 F0.1 F1.1 | F2.0 B0.1 | F3.0 B1.1 | F2.1 B0.0 | F3.1 B1.0 | B2.1 B3.1 B2.0 B3.0
        1    2    3    4    | 5    4    | 5    4    | 5    4    | 5    4    | 3    2    1    0     peak 5
      rank 1, warmup 2·(2 - 1 - 1) + (2 - 1)·2 = 2:
        F0.0 F1.0 | F0.1 B0.1 | F1.1 B1.1 | F2.0 B0.0 | F3.0 B1.0 | F2.1 B2.1 | F3.1 B3.1 | B2.0 B3.0
        1    2    | 3    2    | 3    2    | 3    2    | 3    2    | 3    2    | 3    2    | 1    0     peak 3

    so rank 0 holds 5 units = 10 (microbatch, layer) sets and rank 1 3 units = 6; 1F1B holds 2 x 4 = 8 and
    1 x 4 = 4, GPipe 4 x 4 = 16 on both. The first rank's 10 = L·(1 + (p - 1)/(p·v)) = 8·(1 + 1/4).
    """
    hand = {
        0: "F0.0 F1.0 F0.1 F1.1 F2.0 B0.1 F3.0 B1.1 F2.1 B0.0 F3.1 B1.0 B2.1 B3.1 B2.0 B3.0",
        1: "F0.0 F1.0 F0.1 B0.1 F1.1 B1.1 F2.0 B0.0 F3.0 B1.0 F2.1 B2.1 F3.1 B3.1 B2.0 B3.0",
    }
    orders = [[(op[0], int(op[1]), int(op[3])) for op in hand[r].split()] for r in (0, 1)]
    assert orders == interleaved_orders(2, 4, 2)
    s = AnalyticSchedule("interleaved_1f1b", 2, 4, 2)
    assert (s.in_flight(0), s.in_flight(1)) == (5, 3)
    assert (s.peak_layer_activations(0, 8), s.peak_layer_activations(1, 8)) == (10, 6)
    one_f_one_b = AnalyticSchedule("1f1b", 2, 4)
    assert (one_f_one_b.peak_layer_activations(0, 8), one_f_one_b.peak_layer_activations(1, 8)) == (8, 4)
    assert AnalyticSchedule("gpipe", 2, 4).peak_layer_activations(1, 8) == 16
    sim = simulate(orders, 2, Fraction(1), Fraction(1))
    assert sim.peak == [5, 3]
    assert sim.idle_fraction == Fraction(1, 9) == Fraction(s.bubble).limit_denominator(100)


def test_interleaved_first_rank_holds_one_plus_p_minus_1_over_pv_of_the_layers():
    """With m >= 2p the first rank holds 2(p - 1) + (v - 1)p + 1 = pv + p - 1 units of L/(pv) layers."""
    for p, v in [(2, 2), (4, 2), (4, 3), (8, 4)]:
        layers = p * v * 3
        held = AnalyticSchedule("interleaved_1f1b", p, 4 * p, v).peak_layer_activations(0, layers)
        assert Fraction(held, layers) == 1 + Fraction(p - 1, p * v)
        assert AnalyticSchedule("1f1b", p, 4 * p).peak_layer_activations(0, layers) == layers


def test_interleaved_refuses_microbatches_not_a_multiple_of_stages_whose_bubble_is_larger():
    """Megatron-LM and torchtitan refuse m mod p != 0; the same order then idles more than the closed form."""
    sim = simulate(interleaved_orders(2, 3, 2), 2, Fraction(1, 2), Fraction(1, 2))
    assert sim.idle_fraction > Fraction(1, 2 * 3 + 1)
    with pytest.raises(ValueError, match="multiple of stages"):
        AnalyticSchedule("interleaved_1f1b", 2, 3, 2)
    with pytest.raises(ValueError, match="chunks >= 2"):
        AnalyticSchedule("interleaved_1f1b", 2, 4, 1)
    with pytest.raises(ValueError, match="one chunk"):
        AnalyticSchedule("1f1b", 2, 4, 2)
    with pytest.raises(ValueError, match="not a stage"):
        AnalyticSchedule("1f1b", 2, 4).in_flight(2)
    with pytest.raises(ValueError, match="do not split"):
        AnalyticSchedule("interleaved_1f1b", 2, 4, 2).peak_layer_activations(0, 6)


def test_table_rows():
    rows = table(stages=4, microbatches=8, chunks=2, layers=32)
    assert [r["schedule"] for r in rows] == ["gpipe", "1f1b", "interleaved_1f1b"]
    assert {r["source"] for r in rows} == {"analytic"}
    by = {r["schedule"]: r for r in rows}
    assert by["gpipe"]["bubble"] == by["1f1b"]["bubble"] == pytest.approx(3 / 11)
    assert by["interleaved_1f1b"]["bubble"] == pytest.approx(3 / 19)
    assert [by[n]["first_rank_in_flight"] for n in ("gpipe", "1f1b", "interleaved_1f1b")] == [8, 4, 11]
    assert [by[n]["first_rank_layer_activations"] for n in ("gpipe", "1f1b", "interleaved_1f1b")] == [64, 32, 44]
    assert [by[n]["last_rank_layer_activations"] for n in ("gpipe", "1f1b", "interleaved_1f1b")] == [64, 8, 20]
