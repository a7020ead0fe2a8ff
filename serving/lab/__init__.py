"""The cache-layout lab: the real `Scheduler` and allocator over seeded workloads, without the
model (a cost model gives step times) or through the engine.

    from serving import lab
    wl = lab.make_workload("chat", seed=0, num_conversations=50)
    rows = lab.sweep(wl, lab.LabConfig(pool_blocks=2000), layouts=["v41", "v41_noreplay"],
                     knob="pool_blocks", values=range(500, 4001, 500))
    lab.plot_sweep(rows, "pool_blocks", "out/")

Model-free runs import no JAX. `serving.lab.workloads` (generators, JSONL), `serving.lab.drive`
(the loop, model-free and engine backends), `serving.lab.experiment` (knobs, layouts, runs,
sweeps), `serving.lab.cost` (the step-time model), `serving.lab.plots` (matplotlib, the ``lab``
extra).
"""

from serving.lab.cost import CHIPS, MODELS
from serving.lab.drive import DriveResult, EngineBackend, ModelFreeBackend, drive
from serving.lab.experiment import (
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
from serving.lab.plots import plot_memory, plot_sweep, write_table
from serving.lab.workloads import (
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
