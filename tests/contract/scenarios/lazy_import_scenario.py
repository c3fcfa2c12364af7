"""Importing every ops module must not import torch_npu (it is importable here: the emulation)."""

import sys

import rollout_ext.ops.attention  # noqa: F401
import rollout_ext.ops.linear  # noqa: F401
import rollout_ext.ops.rotary  # noqa: F401
from rollout_ext.ops import npu_available

assert npu_available(), "emulated torch_npu should be importable"
assert "torch_npu" not in sys.modules, "an ops module imported torch_npu at import time"
print("ok: ops import lazily")
