"""Fixtures shared by the Python tests."""

import pytest


@pytest.fixture
def gloo_group(tmp_path):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    dist.init_process_group("gloo", world_size=1, rank=0,
                            init_method=f"file://{tmp_path / 'pg'}")
    try:
        yield dist
    finally:
        dist.destroy_process_group()
