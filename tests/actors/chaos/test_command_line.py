"""``parkway chaos`` refuses a bad command line before it starts anything (the chaos itself runs in
tests/integration/test_chaos.py)."""

from __future__ import annotations

import pytest
from parkway.actors.tools.cli import main


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--minutes", "0"], "--minutes 0.0: want a number of minutes more than 0"),
        (["--minutes", "nan"], "--minutes nan: want a number of minutes more than 0"),
        (["--workloads", "0"], "--workloads 0: want at least 1"),
        (["--workload-timeout", "-1"], "--workload-timeout -1.0: want a number of seconds more than 0"),
        (["--tasks", "5"], "--tasks 5: want 1 to 4 (the built-in bank tasks, 3 rollouts each)"),
        (["--minutes", "5", "--full"], "--minutes draws its workloads from the full matrix already"),
    ],
)
def test_a_bad_command_line_is_refused_with_what_is_wrong(args, message, capsys, tmp_path) -> None:
    assert main(["chaos", "--workdir", str(tmp_path / "chaos"), *args]) == 2
    assert f"parkway: chaos: {message}" in capsys.readouterr().err
    assert not (tmp_path / "chaos").exists()  # nothing was started


def test_a_malformed_number_is_an_argparse_error(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["chaos", "--seed", "seven"])
    assert exited.value.code == 2 and "invalid int value: 'seven'" in capsys.readouterr().err
