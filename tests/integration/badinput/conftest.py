"""Bad-input tests: print the schemathesis summary (cases per operation and status) at the end
of the run, where ``-q`` output still shows it."""

from __future__ import annotations


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    lines = getattr(config, "rf_schemathesis_summary", None)
    if lines:
        terminalreporter.section("schemathesis")
        for line in lines:
            terminalreporter.write_line(line)
