"""The old path of :mod:`reshard.dtensor`, for a compiled core built before the package was
split into subpackages (its ``Layout.from_dtensor`` imports ``layout_of`` from here). Remove once
every build imports :mod:`reshard.dtensor`."""

from .dtensor import layout_of  # noqa: F401
