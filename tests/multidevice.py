"""Running a test script on several host devices, or in several processes.

JAX fixes the host device count when it starts, so the tests of sharded paths run their checks
in a fresh interpreter started with ``--xla_force_host_platform_device_count``. `run_script`
runs one such interpreter; `run_processes` starts several that join one `jax.distributed`
cluster on localhost (each gets its process id and the coordinator's port as ``argv[1]`` and
``argv[2]``, then the given arguments).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def host_devices_env(num_devices: int, *, fast_compile: bool = True) -> dict[str, str]:
    """The environment of a CPU-only interpreter with ``num_devices`` host devices (and, with
    ``fast_compile``, XLA's backend optimisations off: these scripts compile more than they
    run)."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    flags = f" --xla_force_host_platform_device_count={num_devices}"
    if fast_compile:
        flags += " --xla_backend_optimization_level=0"
    env["XLA_FLAGS"] = env.get("XLA_FLAGS", "") + flags
    return env


def run_script(script: str, *args: str, num_devices: int = 8, fast_compile: bool = True) -> str:
    """Run ``script`` (Python source) on ``num_devices`` host devices; its stdout. A non-zero
    exit fails the test with the script's output."""
    run = subprocess.run(
        [sys.executable, "-c", script, *args],
        env=host_devices_env(num_devices, fast_compile=fast_compile),
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def run_processes(
    script: str,
    *args: str,
    num_processes: int = 2,
    devices_each: int = 4,
    timeout: float = 900,
) -> list[str]:
    """Run ``script`` in ``num_processes`` interpreters of ``devices_each`` host devices at once
    (``argv[1]`` the process id, ``argv[2]`` a free coordinator port); each one's output
    (stdout and stderr). Any non-zero exit fails the test with that process's output; a process
    still running when another fails or the time is up is killed."""
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(pid), port, *args],
            env=host_devices_env(devices_each),
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for pid in range(num_processes)
    ]
    outputs = []
    try:
        for p in procs:
            out, _ = p.communicate(timeout=timeout)
            assert p.returncode == 0, out
            outputs.append(out)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return outputs


def expert_parallel_forward(params, cfg, tokens, mesh):
    """``reference.forward`` (fp32 matmuls) under ``mesh`` as JAX's ambient mesh, for the
    scripts: the routed experts go through the expert dispatch, whose all-to-all the lowered
    program must contain. Returns the logits as numpy."""
    import jax
    import numpy as np

    from dsv4 import reference

    with jax.default_matmul_precision("highest"), jax.set_mesh(mesh):
        f = jax.jit(reference.forward, static_argnums=1)
        got = np.asarray(f(params, cfg, tokens))
        assert "all_to_all" in f.lower(params, cfg, tokens).as_text()
    return got


def check_sharded_forward(sharded, want_params, cfg, mesh):
    """For the scripts: ``reference.forward`` of the sharded params equals that of
    ``want_params`` on one device (max abs diff < 1e-4), and so does the expert-parallel
    forward under ``mesh`` (< 1e-5); both differences are printed."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    from dsv4 import reference

    tokens = jnp.asarray(np.random.default_rng(0).integers(3, cfg.vocab_size, (2, 24)), jnp.int32)
    fwd = jax.jit(reference.forward, static_argnums=1)
    with jax.default_matmul_precision("highest"):
        want = np.asarray(fwd(want_params, cfg, tokens))
        got = np.asarray(fwd(sharded, cfg, tokens))
    err = float(np.max(np.abs(got - want)))
    print("max_abs_diff", err)
    assert err < 1e-4, err
    # under the ambient mesh the routed experts run expert-parallel (dsv4.expert_parallel)
    got = expert_parallel_forward(sharded, cfg, tokens, mesh)
    err = float(np.max(np.abs(got - want)))
    print("expert_parallel_max_abs_diff", err)
    assert err < 1e-5, err
