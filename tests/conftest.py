"""Test setup. Without CUDA, Triton kernels run in Triton's interpreter: TRITON_INTERPRET must be
set before any @triton.jit function is defined, so it is set here, before packattn is imported."""

import logging
import os

try:
    import torch

    _has_cuda = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _has_cuda = False
if not _has_cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from hypothesis import HealthCheck, settings  # noqa: E402

settings.register_profile(
    "ci", max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.register_profile(
    "thorough", max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


@pytest.fixture
def restore_logger():
    """The ``packattn.dispatch`` logger, its level and handlers put back after the test (``PACKATTN_LOG=dispatch``
    adds a handler and sets the level)."""
    logger = logging.getLogger("packattn.dispatch")
    level, handlers = logger.level, list(logger.handlers)
    yield logger
    logger.setLevel(level)
    logger.handlers[:] = handlers
