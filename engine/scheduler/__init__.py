"""The engine's scheduler, split by concern:

- batching.py: `Scheduler`, continuous batching with chunked prefill, preemption by recompute,
  and the disaggregated HELD / RESERVED requests (request states: engine/request_state.py);
- prefix_plan.py: prefix-snapshot planning (hits, saves, registered pages, final states);
- priority.py: scheduling classes (interactive before batch; batch prompt chunks kept short);
- spec_depth.py: the pure policy behind a request's speculative draft depth (`SpecDepth`);
- output.py: the typed records a step is planned in (`SchedulerOutput`, `ScheduledRow`).
"""

from engine.scheduler.batching import Scheduler
from engine.scheduler.output import FinalSave, ScheduledRow, SchedulerOutput, final_step

__all__ = ["FinalSave", "ScheduledRow", "Scheduler", "SchedulerOutput", "final_step"]
