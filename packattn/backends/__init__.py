"""The backend registry, in priority order (first capable one wins)."""

from packattn.backends.flex import FlexBackend
from packattn.backends.reference import ReferenceBackend
from packattn.backends.sdpa import SdpaBackend
from packattn.backends.torch_varlen import TorchVarlenBackend
from packattn.backends.triton_varlen import TritonVarlenBackend

REGISTRY = [
    TritonVarlenBackend(),
    TorchVarlenBackend(),
    FlexBackend(),
    SdpaBackend(),
    ReferenceBackend(),
]


def get(name: str):
    for backend in REGISTRY:
        if backend.name == name:
            return backend
    raise KeyError(name)
