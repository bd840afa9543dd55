"""Tables of the benchmark results in ``docs/benchmarks/*.json``, with the machine each ran on.

The files are what ``renderfarm bench pipeline|farm|redis --json`` and the two-stage and GPU
check runs wrote. Their shapes differ by benchmark, so this renders any of them the same way:
the machine (device name, cores, ISA flags, load average, package versions where the file has
them; otherwise the class the file name states), the configuration, each list of rows as a
table and each object of numbers as a two-column table. Per-round lists of numbers stay in the
JSON (the rows carry their mean, median and best). Run it as a script to print the page::

    python docs/hooks/bench_tables.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from mdtable import cell, code, table

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
#: Row columns left out of the tables (long lists and per-module details the JSON keeps).
_SKIP_COLUMNS = {"approximations", "applied", "skipped", "by_command_per_job"}


def _scalar(value: Any) -> bool:
    return value is None or isinstance(value, (str, int, float, bool))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list) and all(_scalar(v) for v in value):
        return ", ".join(_fmt(v) for v in value)
    return cell(value)


def _machine(data: dict[str, Any]) -> dict[str, Any]:
    machine = data.get("machine")
    return machine if isinstance(machine, dict) else {}


def _device(data: dict[str, Any]) -> dict[str, Any]:
    machine = _machine(data)
    phase = data.get("cold") if isinstance(data.get("cold"), dict) else {}  # `bench ready`: per phase
    device = machine.get("device") or data.get("device") or phase.get("device")
    if isinstance(device, dict) and isinstance(phase.get("cpu"), dict) and phase["cpu"].get("isa"):
        device = {**device, "isa": phase["cpu"]["isa"]}
    return device if isinstance(device, dict) else {}


def machine_line(name: str, data: dict[str, Any]) -> str:
    """One sentence naming the machine a result file ran on, from what the file records."""
    device = _device(data)
    machine = _machine(data)
    parts = []
    if device:
        flags = [f for f in ("avx512", "avx512_bf16", "amx") if device.get(f)] or \
            ([f"ISA {device['isa']}"] if device.get("isa") else [])
        cpu = ", ".join([f"{device.get('cpu_cores')} cores", *flags])
        if device.get("kind") == "cpu":
            parts.append(f"{device.get('name')} (cpu, {cpu}, {device.get('total_memory_gb')} GB)")
        else:  # an accelerator's profile carries its host's cores and ISA flags
            parts.append(f"{device.get('name', device.get('kind'))} ({device.get('kind')}, "
                         f"{device.get('total_memory_gb')} GB; host {cpu})")
    elif isinstance(data.get("gpu"), str):
        parts.append(f"{data['gpu']} (torch {data.get('torch')})")
    else:
        stem = name.split("-farm-")[0].split("-redis-")[0].split("-twostage-")[0]
        parts.append(f"the machine class in the file name: `{stem}`")
    if machine.get("nproc"):
        parts.append(f"{machine['nproc']} CPUs visible")
    if machine.get("load_average_before"):
        parts.append(f"load average {machine['load_average_before'][0]} before, "
                     f"{machine.get('load_average_after', ['?'])[0]} after")
    versions = machine.get("packages") or machine.get("versions")
    if isinstance(versions, dict):
        parts.append(", ".join(f"{k} {v}" for k, v in sorted(versions.items()) if _scalar(v) and v))
    return "; ".join(parts)


def _rows_table(rows: list[dict[str, Any]]) -> str:
    columns: list[str] = []
    for row in rows:
        columns += [k for k, v in row.items() if k not in columns and k not in _SKIP_COLUMNS
                    and (_scalar(v) or (isinstance(v, list) and all(isinstance(x, str) for x in v)))]
    return table([cell(c) for c in columns], [[_fmt(row.get(c)) for c in columns] for row in rows])


def _numbers_table(values: dict[str, Any]) -> str:
    flat: list[tuple[str, Any]] = []
    for key, value in values.items():
        if key in _SKIP_COLUMNS:
            continue
        if isinstance(value, dict):
            flat += [(f"{key}.{k}", v) for k, v in value.items() if _scalar(v)]
        elif _scalar(value) or (isinstance(value, list) and all(_scalar(v) for v in value)):
            flat.append((key, value))
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            flat.append((key, f"{len(value)} entries (in the JSON)"))
    return table(("quantity", "value"), [(code(k), _fmt(v)) for k, v in flat]) if flat else ""


def result_section(path: Path) -> str:
    """Markdown for one result file: a heading, the machine, the configuration and its tables."""
    data = json.loads(path.read_text())
    out = [f"## {path.stem}", "", f"**Machine:** {machine_line(path.stem, data)}.", ""]
    config = data.get("config")
    if isinstance(config, dict):
        shown = {k: v for k, v in config.items() if _scalar(v) or isinstance(v, list)}
        out += [f"**Configuration:** `{json.dumps(shown, ensure_ascii=False)}`", ""]
    for key, value in data.items():
        if key in ("config", "machine", "device", "benchmark", "reports", "flops_by_module"):
            continue
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            out += [f"**{key}**", "", _rows_table(value)]
        elif isinstance(value, dict) and value:
            # a list of per-run or per-worker rows is a table of its own; the numbers beside it another
            listed = next((k for k in ("runs", "workers") if isinstance(value.get(k), list) and value[k]), None)
            body = _rows_table(value[listed]) if listed else ""
            numbers = _numbers_table({k: v for k, v in value.items() if k != listed})
            if body or numbers:
                out += [f"**{key}**", "", body, numbers]
    out.append(f"Source: `docs/benchmarks/{path.name}`.\n")
    return "\n".join(s for s in out if s is not None)


def benchmark_results(directory: Path = BENCHMARKS) -> str:
    """Markdown: one section per ``*.json`` result in ``directory``, in name order.

    Raises:
        FileNotFoundError: ``directory`` has no result file (the page would be empty).
    """
    files = sorted(directory.glob("*.json"))
    if not files:
        raise FileNotFoundError(f"no benchmark results (*.json) in {directory}")
    return "\n".join(result_section(f) for f in files)


if __name__ == "__main__":
    print(benchmark_results())
