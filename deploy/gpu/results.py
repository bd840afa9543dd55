"""The results folder of ``deploy/gpu/measure.sh``: part records, packing within a size limit, and a
summary of what each part measured.

Place in the data flow: ``measure.sh`` runs the bench commands, each writing its JSON into a work
folder (rewritten after every round); after every part it calls this script to record the part
(``record``) and to refresh the results folder (``pack``); at the end ``summary`` prints one line
per row. Standard library only: it runs before the carried packages are on the path.

usage::

    python3 deploy/gpu/results.py record WORK PART EXIT SECONDS BUDGET JSON
    python3 deploy/gpu/results.py pack WORK RESULTS RETURN_MIB RETURN_FILES
    python3 deploy/gpu/results.py summary WORK

``pack`` writes ``RESULTS/results.tgz`` with everything in WORK (the compile-cache artifacts under
``WORK/artifacts/`` only while the archive stays under ``RETURN_MIB`` MiB; the others are listed in
``artifacts.json`` with their bytes and SHA-256 instead), then copies ``parts.json`` and the part
JSONs beside it while there are at most ``RETURN_FILES`` files in RESULTS (``run.log`` is written
there directly by the script). A copy-back that brings a few files or a few MiB still brings the
archive.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tarfile
from pathlib import Path

MIB = 2**20


def status(exit_code: int, written: bool) -> str:
    """A part's status from its exit code (-1: not started) and whether its JSON exists:
    ``ok``, ``skipped``, ``budget ran out`` (124, 137: ``timeout``), ``cut short`` (stopped with
    rounds kept) or ``failed``."""
    if exit_code == -1:
        return "skipped"
    if exit_code == 0 and written:
        return "ok"
    if exit_code in (124, 137, 130):
        return "cut short" if written else "budget ran out"
    return "failed"


def record(work: Path, part: str, exit_code: int, seconds: int, budget: int, json_name: str) -> dict:
    """Append one part to ``WORK/parts.json``; returns the entry."""
    path = work / "parts.json"
    parts = json.loads(path.read_text()) if path.exists() else []
    written = (work / json_name).exists()
    entry = {"part": part, "exit": exit_code, "seconds": seconds, "budget_s": budget,
             "json": json_name if written else None, "status": status(exit_code, written)}
    if written:
        result = json.loads((work / json_name).read_text())
        if result.get("complete") is False:
            entry["status"] = "cut short" if entry["status"] == "ok" else entry["status"]
        failed = [f"{r['recipe']} batch {r['batch_size']}" for r in result.get("rows", [])
                  if r.get("status") == "failed"]
        if failed:
            entry["failed_rows"] = failed
    parts.append(entry)
    path.write_text(json.dumps(parts, indent=1))
    return entry


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(MIB), b""):
            digest.update(block)
    return digest.hexdigest()


def pack(work: Path, results: Path, return_mib: float, return_files: int) -> Path:
    """Refresh RESULTS from WORK (see the module docstring); returns the archive's path."""
    results.mkdir(parents=True, exist_ok=True)
    archive = results / "results.tgz"
    artifacts = sorted((work / "artifacts").glob("*")) if (work / "artifacts").is_dir() else []
    plain = [p for p in sorted(work.iterdir()) if p.name != "artifacts" and p.is_file()]
    plain_bytes = sum(p.stat().st_size for p in plain)
    kept, listed, room = [], [], return_mib * MIB - plain_bytes
    for artifact in sorted(artifacts, key=lambda p: p.stat().st_size):
        size = artifact.stat().st_size
        entry = {"name": artifact.name, "bytes": size, "sha256": _sha256(artifact)}
        if size <= room:  # an upper bound: the archive compresses
            kept.append(artifact)
            room -= size
        listed.append({**entry, "in_archive": artifact in kept})
    if listed:
        (work / "artifacts.json").write_text(json.dumps(listed, indent=1))
        plain.append(work / "artifacts.json")
    with tarfile.open(archive.with_suffix(".partial"), "w:gz") as tgz:
        for path in dict.fromkeys(plain):
            tgz.add(path, arcname=path.name)
        for artifact in kept:
            tgz.add(artifact, arcname=f"artifacts/{artifact.name}")
    archive.with_suffix(".partial").replace(archive)
    loose = [work / "parts.json", *sorted(work.glob("*.json"))]
    present = {p.name for p in results.iterdir()}
    for path in dict.fromkeys(loose):
        if path.exists() and (path.name in present or len(present) < return_files):
            shutil.copyfile(path, results / path.name)
            present.add(path.name)
    return archive


def _row_line(row: dict) -> str:
    keys = ("recipe", "batch_size", "status", "cold_s", "settle_s", "hot_median_s_per_img", "hot_best_s_per_img",
            "hot_spread_pct", "images_per_s", "psnr_db", "speedup", "speedup_best", "vs_peer", "vs_peer_best",
            "row", "s_per_frame_median", "s_per_frame_best", "ratio", "peak_mib", "full_passes")  # + bench --video
    return " ".join(f"{k}={row[k]}" for k in keys if row.get(k) is not None)


def summary(work: Path) -> str:
    """One line per part, then one per row of its JSON (a ``bench ready`` result: its phases)."""
    path = work / "parts.json"
    lines = []
    for p in json.loads(path.read_text()) if path.exists() else []:
        lines.append(f"## {p['part']}: {p['status']} (exit {p['exit']}, {p['seconds']} s of {p['budget_s']})")
        if not p["json"]:
            continue
        result = json.loads((work / p["json"]).read_text())
        for row in result.get("rows", []):
            lines.append("  " + _row_line(row))
        for phase in ("cold", "cached"):
            if isinstance(result.get(phase), dict):
                ph = result[phase]
                lines.append(f"  {phase}: ready_s={ph.get('ready_s')} warm_up_s={ph.get('warm_up_s')} "
                             f"compile_cache={(ph.get('compile_cache') or {}).get('outcome')}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    """The command line (see the module docstring); returns the exit status."""
    if not argv or argv[0] not in ("record", "pack", "summary"):
        print(__doc__, file=sys.stderr)
        return 2
    command, args = argv[0], argv[1:]
    if command == "record":
        work, part, exit_code, seconds, budget, json_name = args
        print(json.dumps(record(Path(work), part, int(exit_code), int(seconds), int(budget), json_name)))
    elif command == "pack":
        work, results, return_mib, return_files = args
        pack(Path(work), Path(results), float(return_mib), int(return_files))
    else:
        print(summary(Path(args[0])))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
