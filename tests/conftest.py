"""Test-wide settings: run on the CPU unless the caller chose a platform (the device check
script sets JAX_PLATFORMS itself). Deviceless TPU/GPU compiles do not need a device backend."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
