"""The backend registry, in priority order (first capable one wins)."""

from packattn.backends.fa4 import Fa4Backend
from packattn.backends.flex import FlexBackend
from packattn.backends.reference import ReferenceBackend
from packattn.backends.sdpa import SdpaBackend
from packattn.backends.small_seq import SmallSeqBackend
from packattn.backends.torch_varlen import TorchVarlenBackend
from packattn.backends.triton_tree import TritonTreeBackend
from packattn.backends.triton_varlen import TritonVarlenBackend

# FA4 (only when installed) leads where it supports the call: it measured faster than our Triton
# kernels on W1-W5 (benchmarks/results/2026-11-25/s16_bench_rounds3_h100.*); short batches with gradients
# excepted, where auto dispatch passes it over (`Fa4Backend.defers_to`). torch_varlen before flex: no
# compile on first use.
REGISTRY = [
    SmallSeqBackend(),  # first: it accepts only one query over <= 16 keys, the case it is built for
    Fa4Backend(),
    TritonVarlenBackend(),
    TritonTreeBackend(),
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
