"""The test suite. pytest rewrites the asserts of its helper modules as it does those of the test files and
conftest.py, so that a failing comparison inside a helper shows its values."""

import pytest

pytest.register_assert_rewrite(
    "tests.shared", "tests.algorithms.helpers", "tests.study.policy.helpers", "tests.sweeps.helpers"
)
