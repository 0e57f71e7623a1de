"""A bad dataset file of a `data.source: file` run is refused by the real `rlboost train` in a
second or two, before Prefect, Redis or the run directory: one line naming the setting, the file,
the line and the field, and the fix, exit status 2 (a malformed line, a record without its answer,
an empty file, a file that is not UTF-8, a parquet file with other column names, a path that does
not exist, a bad held-out file). A bad record past the first ones checked is named by the same
line when the session loads the whole file, its traceback in the run log.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rl.prompt_source import CHECKED_RECORDS
from tests.helpers import REPO_ROOT, as_set_flags, save_tiny_model, tiny_run

GOOD = [{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(8)]
JSONL_SHAPE = "fix the file (UTF-8, one JSON object per line with a non-empty string 'prompt' and a string or number 'answer'), or point data."


@dataclass(frozen=True)
class Bad:
    """A bad file (written by `make(directory)`, which returns its path) and the line naming it."""

    make: Callable[[Path], Path]
    line: Callable[[Path], str]
    setting: str = "path"


def _jsonl(path: Path, rows: list[object], tail: str = "") -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows) + tail, encoding="utf-8")
    return path


def _latin1(directory: Path) -> Path:
    path = directory / "train.jsonl"
    path.write_bytes(f'{json.dumps(GOOD[0])}\n{{"prompt": "caf\xe9", "answer": "1"}}\n'.encode("latin-1"))
    return path


def _other_columns(directory: Path) -> Path:
    path = directory / "train.parquet"
    pq.write_table(pa.table({"question": ["1+1="], "solution": ["2"]}), path)
    return path


CASES = {
    "a malformed line": Bad(
        lambda d: _jsonl(d / "train.jsonl", GOOD[:2], '{"prompt": "3+1=" "answer": "4"}\n'),
        lambda f: (
            f"data.path: {f}: line 3: invalid JSON (Expecting ',' delimiter: line 1 column 19 (char 18)); "
            + JSONL_SHAPE
            + "path at another"
        ),
    ),
    "a record without its answer": Bad(
        lambda d: _jsonl(d / "train.jsonl", [*GOOD[:3], {"prompt": "9+1="}]),
        lambda f: (
            f"data.path: {f}: line 4: missing field 'answer' (present keys: ['prompt']); set "
            "data.answer_field to the key that holds the answer, or add 'answer' to every record"
        ),
    ),
    "an empty file": Bad(
        lambda d: _jsonl(d / "train.jsonl", []),
        lambda f: f"data.path: {f}: contains no records; " + JSONL_SHAPE + "path at another",
    ),
    "a file that is not UTF-8": Bad(
        _latin1,
        lambda f: (
            f"data.path: {f}: line 2: not valid UTF-8 ('utf-8' codec can't decode byte 0xe9 in position "
            "15: invalid continuation byte); " + JSONL_SHAPE + "path at another"
        ),
    ),
    "a parquet file with other column names": Bad(
        _other_columns,
        lambda f: (
            f"data.path: {f}: row 1: missing field 'prompt' (present keys: ['question', 'solution']); set "
            "data.prompt_field to the key that holds the prompt, or add 'prompt' to every record"
        ),
    ),
    "a path that does not exist": Bad(
        lambda d: d / "nowhere" / "train.jsonl",
        lambda f: f"data.path: {f}: dataset file not found; point data.path at a .jsonl or .parquet file",
    ),
    "a bad held-out file": Bad(
        lambda d: _jsonl(d / "eval.jsonl", [GOOD[0], {"prompt": "2+2=", "answer": None}]),
        lambda f: (
            f"data.eval_path: {f}: line 2: field 'answer' must be a string or number, got null; "
            + JSONL_SHAPE
            + "eval_path at another"
        ),
        setting="eval_path",
    ),
}


def _children_cpu_s() -> float:
    """CPU seconds of this process's children that have ended."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("bad-data") / "base")


def _train(model: Path, tmp_path: Path, data: dict[str, Path], env: dict[str, str], **overrides: object):
    data_set = {"data.source": "file", **{f"data.{setting}": str(path) for setting, path in data.items()}}
    run = tiny_run(model, tmp_path, "bad-data", 1, {"fabric.enabled": False, **data_set, **overrides})
    command = [sys.executable, "-m", "infra.cli", "train", *as_set_flags(run)]
    return subprocess.run(command, env=env, cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("case", list(CASES))
def test_a_bad_data_file_is_one_line_and_exit_2_before_any_work(case, model, tmp_path):
    bad = CASES[case]
    data = {"path": _jsonl(tmp_path / "good.jsonl", GOOD), "eval_path": _jsonl(tmp_path / "good-eval.jsonl", GOOD)}
    data[bad.setting] = bad.make(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_") and k != "RLBOOST_REDIS_URL"}
    env["RLBOOST_PREFECT_HOME"] = str(tmp_path / "prefect-home")
    started, cpu = time.monotonic(), _children_cpu_s()
    done = _train(model, tmp_path, data, env)
    elapsed, cpu = time.monotonic() - started, _children_cpu_s() - cpu
    print(f"{case}: exit {done.returncode} after {elapsed:.1f} s ({cpu:.1f} s of CPU)\n{done.stdout}{done.stderr}")
    assert done.returncode == 2, done.stdout + done.stderr
    lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
    assert lines == ["cannot start the run", bad.line(data[bad.setting])]
    assert cpu < 5, f"refused after {cpu:.1f} s of CPU"  # wall time depends on what else the cores run
    assert not (tmp_path / "runs").exists(), "the run directory was made"
    assert not (tmp_path / "prefect-home" / "prefect.db").exists(), "Prefect started"


@pytest.mark.integration
def test_a_bad_record_past_those_checked_ends_the_run_with_the_same_line(prefect_harness, model, tmp_path):
    from prefect.settings import PREFECT_API_URL

    rows = [GOOD[i % len(GOOD)] for i in range(CHECKED_RECORDS)] + [{"prompt": "late"}]
    data = {"path": _jsonl(tmp_path / "train.jsonl", rows), "eval_path": _jsonl(tmp_path / "eval.jsonl", GOOD)}
    env = {**os.environ, "PREFECT_API_URL": PREFECT_API_URL.value()}
    done = _train(model, tmp_path, data, env)
    output = done.stdout + done.stderr
    print(output)
    lines = [line for line in output.splitlines() if line.strip()]
    line = (
        f"data.path: {data['path']}: line {CHECKED_RECORDS + 1}: missing field 'answer' (present keys: ['prompt']); "
        "set data.answer_field to the key that holds the answer, or add 'answer' to every record"
    )
    assert done.returncode == 2, output[-4000:]
    assert "Traceback" not in output, output[-4000:]
    assert lines[-1] == line and sum(line in seen for seen in lines) == 1, lines[-3:]
    log = (tmp_path / "runs" / "bad-data" / "driver.log").read_text()
    assert "Traceback" in log and "DatasetError" in log
