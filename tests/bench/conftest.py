"""The benchmark harness runs on the analyser's tiny pair: the same fixtures, shared from there."""

from tests.analysis.conftest import tiny_analysis, tiny_dirs, tiny_models  # noqa: F401  (fixtures, used by name)
