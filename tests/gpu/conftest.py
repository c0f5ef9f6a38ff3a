import pytest
import torch

if not torch.cuda.is_available():
    collect_ignore_glob = ["test_*.py"]


def pytest_collection_modifyitems(items):
    for item in items:
        item.add_marker(pytest.mark.gpu)
