"""The cache-layout lab: the real `Scheduler` and allocator over seeded workloads, without the
model (a cost model gives step times) or through the engine.

Model-free runs import no JAX. Modules: `workloads` (generators, JSONL), `drive` (the loop),
`experiment` (knobs, layouts, runs, sweeps), `cost` (the step-time model), `plots` (matplotlib).
Guide and example: docs/lab.md.
"""

from lab.cost import CHIPS, MODELS
from lab.drive import DriveResult, EngineBackend, ModelFreeBackend, drive
from lab.experiment import (
    KNOBS,
    LAYOUTS,
    RECORDS,
    LabConfig,
    LabError,
    build_layout,
    check_fits,
    min_pool_blocks,
    parse_sweep,
    parse_value,
    run,
    run_engine,
    shortest_hit_prompt,
    sweep,
)
from lab.plots import plot_memory, plot_sweep, write_table
from lab.workloads import (
    WORKLOADS,
    Session,
    Turn,
    Workload,
    WorkloadError,
    load_jsonl,
    make_workload,
    save_jsonl,
)

__all__ = [
    "CHIPS",
    "KNOBS",
    "LAYOUTS",
    "MODELS",
    "RECORDS",
    "WORKLOADS",
    "DriveResult",
    "EngineBackend",
    "LabConfig",
    "LabError",
    "ModelFreeBackend",
    "Session",
    "Turn",
    "Workload",
    "WorkloadError",
    "build_layout",
    "check_fits",
    "drive",
    "load_jsonl",
    "make_workload",
    "min_pool_blocks",
    "parse_sweep",
    "parse_value",
    "plot_memory",
    "plot_sweep",
    "run",
    "run_engine",
    "save_jsonl",
    "shortest_hit_prompt",
    "sweep",
    "write_table",
]
