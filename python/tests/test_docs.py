"""The examples in the package's docstrings run and print what they say."""

import doctest

import reshard


def test_package_docstring_examples():
    result = doctest.testmod(reshard, raise_on_error=False)
    assert result.attempted >= 5 and result.failed == 0
