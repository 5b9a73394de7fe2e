"""Regenerate the table "What the command line and the Python API refuse" (docs/hardening.md) from
real runs of the cases of tests/properties/test_cli_hostile.py and tests/properties/test_api_hostile.py.

    python fuzz/cli_table.py > /tmp/cli_table.md     # from the repository root

Each case is run and checked exactly as the tests check it (exit code, one line, the words expected, nothing
changed at the targets); a case that fails its check stops the script. Paths are shown relative to the
world's folder (``in/``: the inputs, ``out/``: the targets). Cases needing a character device are run only as
root (``os.mknod``); otherwise they are listed as skipped.
"""
from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1] / "tests" / d)
                for d in ("", "unit", "properties", "oracle", "e2e")]  # the test helpers and the test groups

from nnef_kv.errors import clip  # noqa: E402
from cli_world import NO_CHAR_DEVICE, World, run_cli, snapshot, without_paths  # noqa: E402
import test_api_hostile as A  # noqa: E402
import test_cli_hostile as H  # noqa: E402


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("`", "'")


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="nnef-kv-cli-table-"))
    world = World.make(root)
    rows: list[str] = []
    skipped = 0
    for table, cases in H.TABLES.items():
        for case in cases:
            if case.root and not world.has_char:
                skipped += 1
                continue
            world.reset_out()
            before = snapshot(world.out)
            subs = world.subs()
            argv = [a.format(**subs) for a in case.argv]
            t0 = time.perf_counter()
            rc, out, err = run_cli(argv)
            seconds = time.perf_counter() - t0
            H.check_case(world, case, rc, out, err, before)
            if rc == 2:
                line = err.strip().splitlines()[-1]
            else:
                needle = case.needle.format(**subs)
                line = next(ln for ln in (out + err).splitlines() if needle in ln)
            line = clip(without_paths(line, world), 400)
            shown = clip(without_paths(" ".join(["nnef-kv", *argv]), world), 110)
            rows.append(f"| {table} | {_cell(case.what or case.id)} | `{_cell(shown)}` | {rc} | "
                        f"`{_cell(line)}` | {seconds:.3f} |")
    api_rows: list[str] = []
    for case in A.CASES:
        if case.root and not world.has_char:
            skipped += 1
            continue
        import pytest

        try:
            line = A.check_api_case(world, case)
        except pytest.fail.Exception as e:  # pragma: no cover - a regression: say which case
            raise SystemExit(f"API case {case.id} failed its check: {e}") from None
        api_rows.append(f"| {_cell(case.what)} | `{_cell(without_paths(line, world))}` |")
    print("| command | what the user did | command line | exit | message (copied from the run) | seconds |")
    print("|---|---|---|---|---|---|")
    print("\n".join(rows))
    print()
    print("| Python API call | exception: message (copied from the run) |")
    print("|---|---|")
    print("\n".join(api_rows))
    if skipped:
        print(f"\n({skipped} cases skipped: {NO_CHAR_DEVICE})")


if __name__ == "__main__":
    main()
