"""rollout_ext: a vLLM plugin and verl rollout adapter for fast RL rollout on Ascend NPUs.

Importing this package is cheap: it never imports vllm, verl, ray or torch_npu.
"""

__version__ = "0.1.0"
