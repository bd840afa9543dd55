"""The size-limit check of ``make lint`` flags what is over and only that."""

from __future__ import annotations

from pathlib import Path

from tests.size_limits import LIMITS, check, main


def _function(name: str, body_lines: int) -> str:
    return f"def {name}():\n" + "    x = 1\n" * (body_lines - 1)


def test_a_function_over_80_lines_and_a_long_module_are_flagged_and_nothing_else(tmp_path: Path):
    (tmp_path / "ok.py").write_text(_function("short", LIMITS["function"]))
    long_body = _function("long", LIMITS["function"] + 1)
    big = "\n".join([long_body] + ["y = 2"] * (LIMITS["module"] - long_body.count("\n")))
    (tmp_path / "big.py").write_text(big)
    found = [(f.path.name, f.kind, f.name, f.lines) for f in check([str(tmp_path)])]
    assert found == [("big.py", "module", "big", LIMITS["module"] + 1),
                     ("big.py", "function", "long", LIMITS["function"] + 1)]


def test_a_class_over_250_lines_fails_the_command(tmp_path: Path, capsys):
    (tmp_path / "cls.py").write_text("class Big:\n" + "    a = 1\n" * LIMITS["class"])
    assert main([str(tmp_path)]) == 1
    assert "class Big 251 lines (limit 250)" in capsys.readouterr().out
    (tmp_path / "cls.py").write_text("class Small:\n" + "    a = 1\n" * (LIMITS["class"] - 1))
    assert main([str(tmp_path)]) == 0
