"""Stand-ins for torch_npu names nobody emulated: importable, and loud when used.

vllm-ascend binds many torch_npu names at import time (annotations, default arguments). Each such
name resolves to a stand-in; calling it, or making an instance of a class stand-in, raises
NotImplementedError naming the full name. Nothing returns a silent placeholder.
"""

import types


def stand_in(qualified: str):
    message = f"{qualified} is not emulated (rollout_ext torch_npu emulation)"
    short = qualified.rsplit(".", 1)[-1]
    if short[:1].isupper() or short.lstrip("_")[:1].isupper():
        def __new__(cls, *args, **kwargs):
            raise NotImplementedError(message)

        return type(short, (), {"__new__": __new__, "__module__": qualified.rsplit(".", 1)[0]})

    def unemulated(*args, **kwargs):
        raise NotImplementedError(message)

    unemulated.__name__ = short
    unemulated.__qualname__ = qualified
    return unemulated


class Namespace(types.ModuleType):
    """A module whose every unknown attribute is a stand-in (e.g. torch_npu._C)."""

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        value = stand_in(f"{self.__name__}.{name}")
        setattr(self, name, value)
        return value
