"""verl adapter: `actor_rollout_ref.rollout.name=rollout_ext`.

verl loads this package through the `verl.plugins` entry point at the end of `import verl` (or via
VERL_USE_EXTERNAL_MODULES=rollout_ext.verl when entry-point plugins are off). verl only imports an
entry point and never calls into it, so importing this package is the registration; it is cheap and
idempotent and imports neither vLLM nor verl's worker modules (see registration.py).
"""

from rollout_ext.verl.names import BACKEND
from rollout_ext.verl.registration import register

__all__ = ["BACKEND", "register"]

register()
