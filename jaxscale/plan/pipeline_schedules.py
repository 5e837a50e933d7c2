"""Analytic predictions for pipeline schedules this lab does not compile: GPipe, 1F1B and interleaved 1F1B.

The compiled program (jaxscale.model.pipeline) is GPipe, or circular with v visits of each stage, in one JAX
program whose autodiff keeps every in-flight microbatch's residuals. Megatron-LM and torchtitan also run 1F1B
(PipeDream-Flush: Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters Using
Megatron-LM", arXiv:2104.04473, section 2.2.1) and interleaved 1F1B (section 2.2.2: v model chunks per device), which
bound the microbatches a stage holds; they are not built here, so this module gives their bubble, their peak
activations per rank and their point-to-point sends as closed forms, labelled "analytic" (`table`), never measured.
Assumptions, as in the paper's section 2.2: every stage (every chunk) takes the same time, a forward t_f and a
backward t_b per microbatch whatever the stage, and communication is free; under them the bubble does not depend on
t_b / t_f. The warmup counts are Megatron-LM's (megatron/core/pipeline_parallel/schedules.py,
`get_pp_rank_microbatches`, used by `forward_backward_pipelining_without_interleaving` and
`forward_backward_pipelining_with_interleaving`), which PyTorch's torch.distributed.pipelining (torchtitan's
schedules: `Schedule1F1B`, `ScheduleInterleaved1F1B._calculate_single_rank_operations`) computes alike.
"""

from __future__ import annotations

import dataclasses

NAMES = ("gpipe", "1f1b", "interleaved_1f1b")
SOURCE = "analytic"  # the table's label: closed forms, not a compiled program or a measurement


@dataclasses.dataclass(frozen=True)
class AnalyticSchedule:
    """One pipeline schedule: `name` (NAMES), `stages` p (ranks), `microbatches` m a step, `chunks` v model chunks a
    rank (1 except interleaved_1f1b, which takes v >= 2).

    A rank's unit of activations is one microbatch through one chunk: L/p layers (GPipe, 1F1B) or L/(p·v)
    (interleaved). Interleaved 1F1B needs m a multiple of p: Megatron-LM's default microbatch group per virtual
    stage is p microbatches and it refuses a last group of 0 < m mod p < p ("dependency bubbles"), PyTorch's
    ScheduleInterleaved1F1B refuses m mod p != 0; the bubble below holds exactly only then.
    """

    name: str
    stages: int
    microbatches: int
    chunks: int = 1

    def __post_init__(self) -> None:
        if self.name not in NAMES:
            raise ValueError(f"schedule {self.name!r} is not one of {', '.join(NAMES)}")
        if min(self.stages, self.microbatches, self.chunks) < 1:
            raise ValueError(f"{self.name}: stages, microbatches and chunks must be >= 1 (got {self})")
        if self.name != "interleaved_1f1b" and self.chunks != 1:
            raise ValueError(f"{self.name} has one chunk a rank, not {self.chunks}")
        if self.name == "interleaved_1f1b":
            if self.chunks < 2:
                raise ValueError("interleaved_1f1b needs chunks >= 2 (one chunk a rank is 1f1b)")
            if self.microbatches % self.stages:
                raise ValueError(
                    f"interleaved_1f1b needs microbatches a multiple of stages (Megatron-LM, torchtitan): "
                    f"m={self.microbatches}, p={self.stages}"
                )

    @property
    def bubble(self) -> float:
        """The idle fraction of a stage's step: (p - 1)/(m + p - 1) for GPipe and 1F1B, (p - 1)/(v·m + p - 1)
        interleaved.

        The paper (section 2.2.1, 2.2.2) writes the bubble as bubble time over ideal time, b = (p - 1)/m, and
        b = (1/v)·(p - 1)/m interleaved; this is the bubble's share of the whole step, b/(1 + b). The compiled
        GPipe / circular program of jaxscale.model.pipeline.Schedule has the same fraction for v = 1 / v visits.
        """
        p, m, v = self.stages, self.microbatches, self.chunks
        return (p - 1) / (v * m + p - 1)

    def warmup(self, rank: int) -> int:
        """Forward passes (of one chunk each) that `rank` runs before its first backward (Megatron-LM's
        num_warmup_microbatches): GPipe all m; 1F1B min(p - r - 1, m); interleaved
        min(2·(p - r - 1) + (v - 1)·p, m·v) (megatron/core/pipeline_parallel/schedules.py, get_pp_rank_microbatches,
        with microbatch_group_size_per_vp_stage at its default p; Megatron-LM releases before mid-2024 ran all
        m·v forwards first when m == p, this follows the current code).

        Args:
          rank: the 0-based stage index r, 0 <= r < p.

        Returns:
          The number of warmup forwards.
        """
        p, m, v = self.stages, self.microbatches, self.chunks
        self._check(rank)
        if self.name == "gpipe":
            return m
        if self.name == "1f1b":
            return min(p - rank - 1, m)
        return min(2 * (p - rank - 1) + (v - 1) * p, m * v)

    def in_flight(self, rank: int) -> int:
        """Units (one microbatch through one chunk) whose forward `rank` has run and whose backward it has not, at
        its peak: the activations it holds. GPipe m on every rank; 1F1B min(p - r, m); interleaved
        min(2·(p - r - 1) + (v - 1)·p + 1, m·v), in units of L/(p·v) layers.

        After its warmup every 1F1B rank runs one forward then one backward (steady state), so it holds warmup + 1
        at the peak when any microbatch is left past the warmup, else all of them (Megatron-LM's schedules.py).

        Args:
          rank: the 0-based stage index r, 0 <= r < p.

        Returns:
          The peak number of units in flight on that rank.
        """
        total = self.microbatches * self.chunks
        if self.name == "gpipe":
            self._check(rank)
            return total
        return min(self.warmup(rank) + 1, total)

    def layers_per_unit(self, layers: int) -> int:
        """Layers of one unit (one microbatch through one chunk): L/p, or L/(p·v) interleaved.

        Args:
          layers: L, the model's layers (the stack's), divisible by p·v.

        Returns:
          L/(p·v).
        """
        if layers < 1 or layers % (self.stages * self.chunks):
            raise ValueError(f"{self.name}: {layers} layers do not split into {self.stages}x{self.chunks} chunks")
        return layers // (self.stages * self.chunks)

    def peak_layer_activations(self, rank: int, layers: int) -> int:
        """(microbatch, layer) activation sets `rank` holds at its peak: in_flight(rank) x layers_per_unit.

        GPipe holds m·L/p; 1F1B's first rank p·L/p = L whatever m >= p; interleaved's first rank (m >= 2p)
        (v·p + p - 1)·L/(p·v) = L·(1 + (p - 1)/(p·v)), a little more than 1F1B's, for a v-fold smaller bubble time.

        Args:
          rank: the 0-based stage index r, 0 <= r < p.
          layers: L, the model's layers, divisible by p·v.

        Returns:
          The number of (microbatch, layer) activation sets.
        """
        return self.in_flight(rank) * self.layers_per_unit(layers)

    @property
    def permutes_per_microbatch(self) -> int:
        """Point-to-point sends per microbatch across one rank boundary r -> r + 1: a forward activation and a
        backward gradient per chunk visit, 2·v (2 for GPipe and 1F1B). Interleaved, the link from the last rank
        back to the first also carries 2·(v - 1) per microbatch (chunk c's output to chunk c + 1): see
        `sends_per_microbatch`.
        """
        return 2 * self.chunks if self.stages > 1 else 0

    @property
    def sends_per_microbatch(self) -> int:
        """Point-to-point sends per microbatch over the whole pipeline: 2·(p·v - 1), a forward and a backward at
        each of the p·v - 1 hand-offs between consecutive chunks (the paper's section 2.2.2: interleaving multiplies
        the communication by about v); none on one stage, whose chunks share the rank.
        """
        return 2 * (self.stages * self.chunks - 1) if self.stages > 1 else 0

    def _check(self, rank: int) -> None:
        if not 0 <= rank < self.stages:
            raise ValueError(f"rank {rank} is not a stage of {self.stages}")


def table(stages: int, microbatches: int, chunks: int, layers: int) -> list[dict]:
    """One row per schedule (gpipe, 1f1b, interleaved_1f1b with `chunks` chunks a rank), analytic.

    Args:
      stages: p, the pipeline's ranks.
      microbatches: m a step (a multiple of p, for the interleaved row).
      chunks: v >= 2, the interleaved schedule's model chunks a rank.
      layers: L, the model's layers, divisible by p·v.

    Returns:
      Rows with `schedule`, `bubble` (idle share of the step), `first_rank_in_flight` (units: one microbatch
      through one chunk, L/p layers, or L/(p·v) interleaved), `first_rank_layer_activations` and
      `last_rank_layer_activations` ((microbatch, layer) activation sets held at the peak), `source` ("analytic").
    """
    schedules = (
        AnalyticSchedule("gpipe", stages, microbatches),
        AnalyticSchedule("1f1b", stages, microbatches),
        AnalyticSchedule("interleaved_1f1b", stages, microbatches, chunks),
    )
    return [
        {
            "schedule": s.name,
            "bubble": s.bubble,
            "first_rank_in_flight": s.in_flight(0),
            "first_rank_layer_activations": s.peak_layer_activations(0, layers),
            "last_rank_layer_activations": s.peak_layer_activations(stages - 1, layers),
            "source": SOURCE,
        }
        for s in schedules
    ]
