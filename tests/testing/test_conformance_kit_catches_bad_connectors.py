"""The conformance kit fails rule-breaking connectors (a kit that cannot fail proves nothing)."""

from __future__ import annotations

import pytest

from kvwire.engine.engine import build_kv_cache_config
from kvwire.interface.base import KVConnectorRole
from kvwire.testing.instruments import RoleViolationError, enforce_roles
from tests.support.directory_connectors import DirectoryConnector
from tests.support.engines import tiny_config, with_directory_connector

pytest_plugins = ["pytester"]

SUITE_ON_CORRUPTING_CONNECTOR = """
import pytest
from kvwire.testing import ConnectorConformanceSuite, conformance_engine_config
from tests.support.misbehaving_connectors import SilentlyCorruptingConnector

class TestSilentlyCorrupting(ConnectorConformanceSuite):
    @pytest.fixture
    def engine_config(self, tmp_path):
        return conformance_engine_config(
            SilentlyCorruptingConnector, extra_config={"store_dir": str(tmp_path / "store")}
        )
"""


def test_the_suite_fails_a_connector_that_silently_corrupts_loaded_blocks(
    pytester: pytest.Pytester,
) -> None:
    pytester.makepyfile(test_corrupting=SUITE_ON_CORRUPTING_CONNECTOR)
    result = pytester.runpytest_inprocess(
        "-q", "-p", "no:cacheprovider", "-k", "bit_identical or outputs_equal_without"
    )
    result.assert_outcomes(failed=2)


def test_strict_roles_refuse_a_scheduler_question_to_a_worker_connector(tmp_path) -> None:
    config = with_directory_connector(tiny_config(), tmp_path)
    worker = DirectoryConnector(config, KVConnectorRole.WORKER, build_kv_cache_config(config))
    enforce_roles(worker)
    with pytest.raises(
        RoleViolationError,
        match=r"DirectoryConnector.request_finished is a scheduler-side call, "
        r"but this instance has the WORKER role",
    ):
        worker.request_finished(None, [])  # type: ignore[arg-type]
