"""The CLI's resource-limit flags reach the archive reader, and bad values are refused before any work."""
from __future__ import annotations

from nnef_kv import cli
from nnef_kv.limits import DEFAULT_LIMITS, current_limits
from nnef_kv.samples import sample_path


def test_max_members_flag_is_enforced(capsys) -> None:
    rc = cli.main(["--max-members", "3", "inspect", str(sample_path())])
    err = capsys.readouterr().err
    assert rc == cli.EXIT_USAGE
    assert "max_members=3" in err and str(sample_path()) in err
    assert len(err.strip().splitlines()) == 1


def test_max_tensor_bytes_flag_is_enforced(capsys) -> None:
    rc = cli.main(["--max-tensor-bytes", "16", "inspect", str(sample_path())])
    err = capsys.readouterr().err
    assert rc == cli.EXIT_USAGE and "16" in err


def test_generous_limits_pass_and_do_not_leak(capsys) -> None:
    rc = cli.main(["--max-members", "1000", "--max-archive-bytes", str(1 << 30), "inspect", str(sample_path())])
    assert rc == cli.EXIT_OK
    assert "graph tiny_decoder" in capsys.readouterr().out
    assert current_limits() == DEFAULT_LIMITS  # the override ends with the command


def test_bad_limit_value_refused(capsys) -> None:
    rc = cli.main(["--max-nesting", "0", "inspect", str(sample_path())])
    assert rc == cli.EXIT_USAGE
    assert "--max-nesting 0" in capsys.readouterr().err
