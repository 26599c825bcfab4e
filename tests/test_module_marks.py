"""tests/support/module_marks.py: which modules `make test-fast` may leave unimported (tests/conftest.py's
pytest_ignore_collect). It reads a module's ``pytestmark`` without importing the module, and judges the ``-m``
expression with pytest's own parser (``_pytest.mark.expression``, private: this test is its fence)."""

from __future__ import annotations

import sys

import pytest

from tests.support.module_marks import deselects_whole_module, module_marks

FAST = "not (model or subprocess or browser or slow or gpu)"


def write(tmp_path, source: str):
    path = tmp_path / "test_example.py"
    path.write_text(source)
    return path


def test_a_module_marked_model_is_left_out_of_the_fast_run_only(tmp_path):
    path = write(tmp_path, "import pytest\nimport heavy_library_never_imported\n"
                           "pytestmark = [pytest.mark.timeout(300), pytest.mark.model]\n")
    assert module_marks(path) == {"timeout", "model"}
    assert deselects_whole_module(path, FAST)
    assert not deselects_whole_module(path, "model")
    assert not deselects_whole_module(path, "")
    # a test of the module may carry slow besides model: "model and slow" could select it
    assert not deselects_whole_module(path, "model and slow")
    assert deselects_whole_module(path, "not model and slow")
    assert "heavy_library_never_imported" not in sys.modules


def test_marks_named_by_a_tests_helper_are_read_through_that_helper_alone(tmp_path):
    path = write(tmp_path, "import pytest\nimport torch_is_not_needed_here\n"
                           "from tests.test_module_marks import FAST, HELPER_MARKS\npytestmark = HELPER_MARKS\n")
    assert module_marks(path) == {"slow"}
    assert deselects_whole_module(path, FAST)


HELPER_MARKS = [pytest.mark.slow]


@pytest.mark.parametrize("source", [
    "import pytest\n\ndef test_unmarked():\n    pass\n",
    "import pytest\nfrom somewhere import MARKS\npytestmark = MARKS\n",  # not a tests.* helper: not evaluated
    "import pytest\npytestmark = pytest.mark.model\n",
])
def test_a_module_is_collected_unless_its_marks_are_known_to_be_deselected(tmp_path, source):
    path = write(tmp_path, source)
    expected = source.endswith("pytest.mark.model\n")
    assert deselects_whole_module(path, FAST) is expected
    # marks with keyword arguments in the expression are not judged here
    assert not deselects_whole_module(path, "not model(reason='x')")
