"""Pure-torch emulation of the torch_npu ops rollout_ext calls (tests only; CPU tensors).

Importing it does what the real package does to torch at import: the PrivateUse1 device is named
"npu" and an "hccl" collective backend is registered for it (here: gloo underneath, with
`get_hccl_comm_name`). Each op binds its arguments against the real 2.14 schema (`_schema.bind`)
and then computes the op's DOCUMENTED math. Nothing here runs a real kernel.
"""

import itertools

import torch
import torch.distributed as dist

from torch_npu import _schema
from torch_npu._schema import CALLS, bind  # noqa: F401

torch.utils.rename_privateuse1_backend("npu")


class _NoDeviceHooks(torch._C._acc.PrivateUse1Hooks):
    """The real package registers its device hooks in C++; here they say that no device exists, so
    torch.distributed (e.g. barrier) keeps host tensors on the host."""

    def is_available(self) -> bool:
        return False

    def has_primary_context(self, dev_id) -> bool:
        return False

    def is_built(self) -> bool:
        return True


torch._C._acc.register_python_privateuseone_hook(_NoDeviceHooks())

__version__ = "2.14.0"  # the schemas every emulated op binds against

# ---- the import-time surface vllm-ascend touches (no computation behind it) ----
import sys as _sys  # noqa: E402

from torch_npu import npu  # noqa: E402
from torch_npu._unemulated import Namespace, stand_in  # noqa: E402

_C = Namespace("torch_npu._C")
_sys.modules["torch_npu._C"] = _C

torch.npu = npu
_sys.modules["torch.npu"] = npu

# Dtypes: torch's own where torch has them; NPU-only ones are tags that no emulated op accepts.
float4_e2m1fn_x2 = torch.float4_e2m1fn_x2
float8_e8m0fnu = torch.float8_e8m0fnu


class _NpuOnlyDtype:
    def __init__(self, name: str):
        self.name = name

    def __repr__(self) -> str:
        return f"torch_npu.{self.name} (emulated tag)"


hifloat8 = _NpuOnlyDtype("hifloat8")


def __getattr__(name: str):
    """An op nobody emulated: importable (vllm-ascend binds names at import), raises when called."""
    if not (name.startswith("npu_") or name.startswith("_npu_")):
        raise AttributeError(f"module 'torch_npu' (emulation) has no attribute {name!r}")
    return stand_in(f"torch_npu.{name}")


# ---- HCCL backend emulation: communicator name <-> backend registry (emulation only) ----
class EmulatedHcclBackend(dist.ProcessGroupGloo):
    """Gloo collectives under the HCCL backend name, plus torch_npu's comm-name lookup."""

    def get_hccl_comm_name(self, rank: int, init_comm: bool = True) -> str:
        return self.comm_name


HCCL_COMMS: dict[str, EmulatedHcclBackend] = {}
_comm_ids = itertools.count()


def _create_hccl_backend(store, rank, size, timeout):
    backend = EmulatedHcclBackend(store, rank, size, timeout)
    # Groups are created in the same order on every rank, so names agree across ranks.
    backend.comm_name = f"emu_hccl_comm_{next(_comm_ids)}"
    HCCL_COMMS[backend.comm_name] = backend  # also keeps the Python subclass alive
    return backend


dist.Backend.register_backend("hccl", _create_hccl_backend, devices=["npu"])


class _HcclOptions(torch._C._distributed_c10d.Backend.Options):
    """torch_npu._C._distributed_c10d.ProcessGroupHCCL.Options: the fields torch_npu binds
    (op_timeout, is_high_priority_stream, global_ranks_in_group, hccl_config, group_id) on the base
    Backend.Options, with backend "hccl". The emulated backend is gloo underneath and reads none of
    them; vllm-ascend's GroupCoordinator builds one per group before creating it."""

    def __init__(self):
        super().__init__("hccl")
        self.op_timeout = self._timeout
        self.is_high_priority_stream = False
        self.global_ranks_in_group = []
        self.hccl_config = {}
        self.group_id = ""


_distributed_c10d = Namespace("torch_npu._C._distributed_c10d")
_distributed_c10d.ProcessGroupHCCL = type("ProcessGroupHCCL", (EmulatedHcclBackend,), {"Options": _HcclOptions})
_C._distributed_c10d = _distributed_c10d
_sys.modules["torch_npu._C._distributed_c10d"] = _distributed_c10d


# ---- npu_apply_rotary_pos_emb (aclnnApplyRotaryPosEmb, documented formula) ----
def _rotate_half(x):
    first, second = torch.chunk(x, 2, dim=-1)
    return torch.cat((-second, first), dim=-1)


def npu_apply_rotary_pos_emb(*args, **kwargs):
    """q = q*cos + rotate_half(q)*sin, same for k, written in place; returns (query, key)."""
    a = bind("npu_apply_rotary_pos_emb", args, kwargs)
    query, key, cos, sin = a["query"], a["key"], a["cos"], a["sin"]
    if a["layout"] != "BSND":
        raise NotImplementedError(f"emulation models layout BSND only, got {a['layout']}")
    if a["rotary_mode"] != "half":
        raise NotImplementedError(f"emulation models rotary_mode 'half' only, got {a['rotary_mode']}")
    for name, t in (("query", query), ("key", key), ("cos", cos), ("sin", sin)):
        if t.dim() != 4:
            raise ValueError(f"npu_apply_rotary_pos_emb: {name} must be 4-D BSND, got {tuple(t.shape)}")
    head_dim = query.shape[-1]
    if head_dim not in (64, 128) or key.shape[-1] != head_dim:
        raise ValueError(f"npu_apply_rotary_pos_emb: head dim must be 64 or 128, got {head_dim}")
    if query.shape[:2] != key.shape[:2]:
        raise ValueError("npu_apply_rotary_pos_emb: query and key must share B and S")
    expected_cs = (query.shape[0], query.shape[1], 1, head_dim)
    if tuple(cos.shape) != expected_cs or tuple(sin.shape) != expected_cs:
        raise ValueError(f"npu_apply_rotary_pos_emb: cos/sin must be {expected_cs}, got {tuple(cos.shape)}")
    if len({query.dtype, key.dtype, cos.dtype, sin.dtype}) != 1:
        raise TypeError("npu_apply_rotary_pos_emb: query, key, cos, sin must share one dtype")
    query.copy_(query * cos + _rotate_half(query) * sin)
    key.copy_(key * cos + _rotate_half(key) * sin)
    return query, key


# ---- _npu_rotary_embedding (ATB RopeOperation via op-plugin RopeAtb.cpp) ----
# Like the real op, the first cos_sin_cache ever seen is kept for the life of the process.
_ATB_ROPE_CACHED_TABLE: list[torch.Tensor] = []


def _rotate_interleaved(x):
    even, odd = x[..., ::2], x[..., 1::2]
    return torch.stack((-odd, even), dim=-1).flatten(-2)


def _npu_rotary_embedding(*args, **kwargs):
    """In place on query/key [T, heads*width]; width = cos_sin_cache's last dim. rotaryCoeff is
    2 (halves) for neox, else head_size, which must equal the width (pairs interleaved)."""
    a = bind("_npu_rotary_embedding", args, kwargs)
    positions, query, key = a["positions"], a["query"], a["key"]
    if not _ATB_ROPE_CACHED_TABLE:
        _ATB_ROPE_CACHED_TABLE.append(a["cos_sin_cache"].clone())
    table = _ATB_ROPE_CACHED_TABLE[0]  # the quirk: later tables are ignored
    width = table.shape[-1]
    for name, t in (("query", query), ("key", key)):
        if t.dtype not in (torch.float16, torch.bfloat16):
            raise TypeError(f"_npu_rotary_embedding: {name} must be fp16 or bf16, got {t.dtype}")
        if t.dim() != 2 or not t.is_contiguous():
            raise ValueError(f"_npu_rotary_embedding: {name} must be contiguous 2-D [T, hidden]")
        if t.shape[0] != positions.numel() or t.shape[1] % width:
            raise ValueError(f"_npu_rotary_embedding: {name} {tuple(t.shape)} does not fit width {width}")
    cos_half, sin_half = table.index_select(0, positions.flatten()).chunk(2, dim=-1)
    if a["is_neox_style"]:
        cos, sin, rotate = torch.cat((cos_half,) * 2, -1), torch.cat((sin_half,) * 2, -1), _rotate_half
    else:
        if a["head_size"] != width:
            raise ValueError(
                f"_npu_rotary_embedding: rotaryCoeff=head_size={a['head_size']} must equal the "
                f"cos width {width} in interleaved mode"
            )
        cos = cos_half.repeat_interleave(2, dim=-1)
        sin = sin_half.repeat_interleave(2, dim=-1)
        rotate = _rotate_interleaved
    for t in (query, key):
        heads = t.view(t.shape[0], -1, width)
        c, s = cos.unsqueeze(1).to(t.dtype), sin.unsqueeze(1).to(t.dtype)
        heads.copy_(heads * c + rotate(heads) * s)


# ---- npu_mrope (aclnnRopeWithSinCosCache; what vllm-ascend's rope calls per layer) ----
def npu_mrope(*args, **kwargs):
    """Returns new (query, key) [T, heads*head_size]. cos_sin_cache [max_pos, rotary_dim] holds cos
    then sin halves; rotary_dim is its last dim. Each head's first rotary_dim dims are rotated
    ("half": neox halves, "interleaved": GPT-J pairs), the rest pass through. Every call gathers
    the rows for `positions` from the whole table: the per-layer gather rope_cache removes."""
    a = bind("npu_mrope", args, kwargs)
    positions, query, key, table, head_size = (
        a["positions"], a["query"], a["key"], a["cos_sin_cache"], a["head_size"]
    )
    if a["mrope_section"] not in (None, [0, 0, 0]):
        raise NotImplementedError(f"npu_mrope: emulation models plain rope only, got mrope_section={a['mrope_section']}")
    if a["cache_mode"] != "default":
        raise NotImplementedError(f"npu_mrope: emulation models cache_mode 'default' only, got {a['cache_mode']}")
    if a["rotary_mode"] not in ("half", "interleaved"):
        raise ValueError(f"npu_mrope: rotary_mode must be 'half' or 'interleaved', got {a['rotary_mode']}")
    if positions.dim() != 1:
        raise NotImplementedError("npu_mrope: emulation models 1-D positions only")
    rotary_dim = table.shape[-1]
    for name, t in (("query", query), ("key", key)):
        if t.dim() != 2 or t.shape[0] != positions.shape[0] or t.shape[1] % head_size:
            raise ValueError(f"npu_mrope: {name} {tuple(t.shape)} is not [T, heads*{head_size}]")
    if rotary_dim > head_size or rotary_dim % 2:
        raise ValueError(f"npu_mrope: rotary dim {rotary_dim} does not fit head_size {head_size}")
    cos_half, sin_half = table.index_select(0, positions).chunk(2, dim=-1)
    if a["rotary_mode"] == "half":
        cos, sin, rotate = torch.cat((cos_half,) * 2, -1), torch.cat((sin_half,) * 2, -1), _rotate_half
    else:
        cos, sin = cos_half.repeat_interleave(2, -1), sin_half.repeat_interleave(2, -1)
        rotate = _rotate_interleaved
    outputs = []
    for t in (query, key):
        heads = t.view(t.shape[0], -1, head_size)
        rot, passed = heads[..., :rotary_dim], heads[..., rotary_dim:]
        c, s = cos.unsqueeze(1).to(t.dtype), sin.unsqueeze(1).to(t.dtype)
        outputs.append(torch.cat((rot * c + rotate(rot) * s, passed), dim=-1).reshape(t.shape))
    return outputs[0], outputs[1]


# ---- npu_rms_norm / npu_add_rms_norm / npu_swiglu (aclnn RmsNorm, AddRmsNorm, SwiGlu) ----
def _rms_norm(x, gamma, epsilon):
    x32 = x.float()
    rstd = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + epsilon)
    return (x32 * rstd * gamma.float()).to(x.dtype), rstd


def npu_rms_norm(*args, **kwargs):
    """(y, rstd): y = x / sqrt(mean(x^2) + epsilon) * gamma over the last dim, rstd in fp32."""
    a = bind("npu_rms_norm", args, kwargs)
    x, gamma = a["input"], a["gamma"]
    if gamma.shape != x.shape[-gamma.dim():]:
        raise ValueError(f"npu_rms_norm: gamma {tuple(gamma.shape)} does not match input {tuple(x.shape)}")
    return _rms_norm(x, gamma, a["epsilon"])


def npu_add_rms_norm(*args, **kwargs):
    """(y, rstd, x): x = x1 + x2, then npu_rms_norm(x, gamma, epsilon)."""
    a = bind("npu_add_rms_norm", args, kwargs)
    x1, x2, gamma = a["x1"], a["x2"], a["gamma"]
    if x1.shape != x2.shape or x1.dtype != x2.dtype:
        raise ValueError(f"npu_add_rms_norm: x1 {tuple(x1.shape)} and x2 {tuple(x2.shape)} must match")
    x = x1 + x2
    y, rstd = _rms_norm(x, gamma, a["epsilon"])
    return y, rstd, x


def npu_swiglu(*args, **kwargs):
    """SwiGlu(x) = Swish(A) * B with A, B the two halves of x along `dim`."""
    a = bind("npu_swiglu", args, kwargs)
    x, dim = a["input"], a["dim"]
    if x.shape[dim] % 2:
        raise ValueError(f"npu_swiglu: dim {dim} of {tuple(x.shape)} must be even")
    first, second = x.chunk(2, dim=dim)
    return torch.nn.functional.silu(first) * second


# ---- npu_mm_all_reduce_base (MatmulAllReduce, documented formula) ----
def npu_mm_all_reduce_base(*args, **kwargs):
    """output = allreduce(x1 @ x2 + bias) over the group named by hcom (sum only)."""
    a = bind("npu_mm_all_reduce_base", args, kwargs)
    x1, x2, bias = a["x1"], a["x2"], a["bias"]
    if a["reduce_op"] != "sum":
        raise ValueError(f"npu_mm_all_reduce_base: only reduce_op='sum' is supported, got {a['reduce_op']}")
    if x1.dim() not in (2, 3) or x2.dim() != 2 or x2.shape[0] != x1.shape[-1]:
        raise ValueError(f"npu_mm_all_reduce_base: bad shapes x1 {tuple(x1.shape)} x2 {tuple(x2.shape)}")
    if x1.dtype not in (torch.float16, torch.bfloat16) or x2.dtype != x1.dtype:
        raise TypeError("npu_mm_all_reduce_base: unquantized x1/x2 must both be fp16 or both bf16")
    if bias is not None and (bias.dim() != 1 or bias.shape[0] != x2.shape[1] or bias.dtype != x1.dtype):
        raise ValueError("npu_mm_all_reduce_base: bias must be 1-D [n] with x1's dtype")
    backend = HCCL_COMMS.get(a["hcom"])
    if backend is None:
        raise ValueError(f"npu_mm_all_reduce_base: unknown hcom {a['hcom']!r}")
    out = x1 @ x2
    if bias is not None:
        out = out + bias
    out = out.contiguous()
    backend.allreduce([out]).wait()
    return out


from torch_npu import atb  # noqa: E402  (atb ops are exposed as torch_npu.atb.*)
