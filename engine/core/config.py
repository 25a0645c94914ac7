"""The core's configuration and the names of its layouts and admission policies (torch-free,
so the CLI parses flags without loading the model stack)."""
from __future__ import annotations

import dataclasses

from engine.protocol import MAX_INPUT_BYTES, StepCache

LAYOUTS = ("compact", "padded", "bucketed")
ADMISSIONS = ("continuous", "static")
POLICIES = ("fifo", "srpt")


@dataclasses.dataclass
class CoreConfig:
    slots: int = 16  # slots per group (latent shape)
    layout: str = "compact"
    admission: str = "continuous"
    max_queue: int = 64  # requests waiting in front of admission; beyond it: Rejected
    decode_buffers: int | None = None  # decode-arena buffers, one held per request from admission
    # until decoded; default 2 × slots, so decoding never caps the batch on its own
    max_steps: int = 500
    trajectory_budget_bytes: int | None = None  # default: `slots` requests at the native size
    output_budget_bytes: int | None = None  # default: `slots + decode_buffers` native outputs
    device: str = "cpu"
    embedding_cache_entries: int = 1024  # prompts whose encoder rows are kept for reuse
    embedding_cache_bytes: int = 256 << 20  # and at most this many bytes of them
    # admission order: srpt (least remaining evaluations first, aged: see engine.core.scheduling.scheduler;
    # measured in bench/RESULTS.md), or fifo
    policy: str = "srpt"
    # which group runs next: the one whose next request finishes soonest, but a group that
    # waited this × (other runnable groups) batches goes first; 0: round robin
    group_aging: float = 2.0
    max_groups: int = 8  # live slot groups (one per latent shape); idle ones are evicted beyond it
    bypass_limit: int = 8  # later requests that may pass one waiting for memory before it blocks
    # srpt: work admitted while a request waits, at most this × (work queued ahead of it + its own)
    srpt_aging: float = 2.0
    # priorities: a lower priority's request goes first once the work admitted while it waits
    # exceeds this × (all the work queued ahead of it when it arrived + its own)
    priority_aging: float = 8.0
    # a request of higher priority that cannot be admitted parks running requests of a lower
    # one at a step boundary (their slot state to host memory), each only after it ran
    # `preempt_min_steps` steps since its last admission and at most `max_preemptions` times
    preemption: bool = True
    preempt_min_steps: int = 2
    max_preemptions: int = 3
    parked_budget_bytes: int | None = None  # host bytes of parked slot state; default: the trajectory budget
    oom_recovery_batches: int = 64  # batches at a lowered row limit before it doubles back
    max_schedules: int = 1024  # cached schedules (sampler, steps, size options)
    cuda_graphs: bool = True  # bucketed layout on CUDA: the denoiser replayed from one CUDA graph per bucket
    fence_wait_s: float = 0.002  # longest sleep on a fence when nothing else can run (input latency bound)
    max_input_bytes: int = MAX_INPUT_BYTES  # each byte input (an image, a mask) at most this many bytes
    cache: StepCache | None = None  # the step cache of requests that name none (`--cache`); None: off

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {LAYOUTS}, not {self.layout!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, not {self.policy!r}")
        if self.admission not in ADMISSIONS:
            raise ValueError(f"admission must be one of {ADMISSIONS}, not {self.admission!r}")
        if self.decode_buffers is None:
            self.decode_buffers = 2 * self.slots
        if self.slots < 1 or self.max_queue < 0 or self.decode_buffers < 1 or self.max_steps < 1 \
                or self.embedding_cache_entries < 1 or self.max_groups < 1 or self.max_input_bytes < 1 \
                or self.srpt_aging < 0 or self.group_aging < 0 or self.priority_aging < 0 or self.preempt_min_steps < 0 \
                or self.max_preemptions < 0:
            raise ValueError("slots, decode_buffers, max_steps, embedding_cache_entries, max_groups and "
                             "max_input_bytes must be positive; max_queue, srpt_aging, group_aging, priority_aging, preempt_min_steps and "
                             "max_preemptions non-negative")
