"""`infra.cli.failures.check_run_directory`: `rlboost train` refuses a run directory that cannot be
made before it imports anything heavy, with the line `claim_run_directory` would end with, and
writes nothing (a read-only file system, end to end: tests/infra/cli/test_error_classes.py)."""

from __future__ import annotations

import pytest

from infra.cli.failures import NamedFailure, check_run_directory, claim_run_directory


def test_a_run_directory_below_a_file_is_refused_with_the_line_of_its_claim(tmp_path):
    (tmp_path / "a-file").write_text("not a directory")
    directory = tmp_path / "a-file" / "runs" / "demo"
    with pytest.raises(NamedFailure) as checked:
        check_run_directory(directory)
    with pytest.raises(NamedFailure) as claimed:
        claim_run_directory(directory)
    assert checked.value.code == claimed.value.code == 2
    assert checked.value.line == claimed.value.line
    assert checked.value.line.startswith(f"cannot write the run directory {directory} (Not a directory: ")


@pytest.mark.parametrize("exists", [False, True])
def test_a_run_directory_that_can_be_made_passes_and_nothing_is_written(tmp_path, exists):
    directory = tmp_path / "runs" / "demo"
    if exists:
        directory.mkdir(parents=True)
    check_run_directory(directory)
    assert directory.is_dir() == exists and sorted(tmp_path.rglob("*")) == (
        [tmp_path / "runs", directory] if exists else []
    )
