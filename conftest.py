"""Test-session set-up shared by doctests and tests/.

jax reads XLA_FLAGS once, when its CPU backend starts: 16 host devices let the
layout tests place meshes of up to 16 ranks.
"""

import os

_FLAG = "--xla_force_host_platform_device_count=16"
if _FLAG.split("=")[0] not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + _FLAG).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
