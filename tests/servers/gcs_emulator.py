import pytest
@pytest.fixture
def gcs_server(): pytest.skip("todo")
@pytest.fixture
def gcs_server_private(): pytest.skip("todo")
