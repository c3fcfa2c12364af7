"""npu_available() follows importability of torch_npu and its cache can be reset."""

import pathlib
import sys

from rollout_ext.ops import npu_available, reset_npu_cache

EMU_DIR = pathlib.Path(__file__).resolve().parents[1] / "contract" / "emu"


def test_ops_npu_available_cached_and_resettable():
    reset_npu_cache()
    assert npu_available() is False
    sys.path.insert(0, str(EMU_DIR))
    try:
        assert npu_available() is False  # cached
        reset_npu_cache()
        assert npu_available() is True
        assert "torch_npu" not in sys.modules  # find_spec does not import it
    finally:
        sys.path.remove(str(EMU_DIR))
        reset_npu_cache()
    assert npu_available() is False
