#!/usr/bin/env python3
"""Proof that the emulated-device tests can fail: delete each stream/event or memory rule's line in csrc/, one at a time.

The rules live in csrc/transfer.cpp (tagged I1-I4 and Mn there), except M10 (host pool), M11 (prefetch order) and
M18 (unpack waits for a spill read) and M19 (the pack's graph-capture guard, csrc/scope.cpp). M20: a spill write of
a host copy waits for that copy (csrc/transfer.cpp). M21-M23 are memory rules of the records (csrc/scope.cpp and
csrc/records.cpp: what a copy spans, one restore per record and round, the prefetch group of a record saved by
several layers); the emulated device's allocator counters catch them. M24 (csrc/scope.cpp): a save shares another
record's copy only for bytes an earlier save referenced, or as a sibling view made by the same node; a stale-bytes
test catches it.

For every mutation below, a scratch copy of the sources gets that one line removed (or replaced), the op library is
rebuilt from the copy, and tests/device/emu runs against it (HSOFFLOAD_LIBRARY points the loader at the mutant). A
mutation that no test catches is a missing test: the script exits 1 and names it. The unmutated build must pass first.

Usage: python scripts/mutation_check.py [--only ID ...] [--markdown FILE]    (make mutation-check)
Takes 30-90 s per mutation on 2 cores (incremental rebuild of one file, then the emulated-device suite).
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRATCH = ROOT / "build" / "mutation"
logger = logging.getLogger("hsoffload.mutation")


@dataclasses.dataclass(frozen=True)
class Mutation:
    id: str
    rule: str
    file: str
    line: str  # the exact source line (stripped) that enforces the rule
    replacement: str = ""  # what replaces it ("" deletes it)


MUTATIONS = [
    Mutation("M1", "pack: D waits for the producer on C (e_prod)", "csrc/transfer.cpp",
             "produced.block(copy_stream);  // I1 (M1): the copy reads the bytes only after the compute stream wrote them"),
    Mutation("M2", "pack: x's device block held until the copy on D has read it", "csrc/transfer.cpp",
             "uses.hold_source(src.storage(), d2h_done);"),
    Mutation("M3", "pack: host block's last use := d2h_done", "csrc/transfer.cpp",
             "host.record_use(d2h_done);  // I2 (M3): the pool lends the block again only after the copy wrote it"),
    Mutation("M4", "restore: H waits for the allocation point on C (e_alloc)", "csrc/transfer.cpp",
             "allocated.block(copy_stream);  // I1 (M4): the block's previous users on the compute stream are done"),
    Mutation("M5", "restore: H waits for d2h_done", "csrc/transfer.cpp",
             "d2h_done->block(copy_stream);  // I2 (M5): host bytes are complete before we read them"),
    Mutation("M6", "restore: restored block held until the copy on H has written it", "csrc/transfer.cpp",
             "uses.hold_restore(dev.storage(), order.done, compute);  // I1 (M6, M25): the copy writes it on H; held, never tagged"),
    Mutation("M7", "restore: host block's last use := h2d_done", "csrc/transfer.cpp",
             "host.record_use(order.done);  // I2 (M7): the pool lends the block again only after the copy read it"),
    Mutation("M8", "unpack: the consumer's stream waits h2d_done", "csrc/transfer.cpp",
             "done.block(consumer);  // I3 (M8): the consumer reads the restored bytes only after the copy wrote them"),
    Mutation("M9", "unpack: a block consumed on another stream is held until that stream's work is queued",
             "csrc/transfer.cpp",
             "uses.hold_consumer(dev.storage(), consumer, *alloc_stream);  // I1 (M9): a foreign consumer's use"),
    Mutation("M10", "pool: returned extents are lent again only after their last use completed", "csrc/host_pool.cpp",
             "if (last_use && !event_completed(*last_use)) {  // never throws: reached from destructors (events.h)", "if (false) {"),
    Mutation("M11", "prefetch runs in reverse pack order", "csrc/prefetch.cpp",
             "for (auto it = records.rbegin(); it != records.rend() && more(); ++it) {",
             "for (auto it = records.begin(); it != records.end() && more(); ++it) {"),
    Mutation("M12", "copies are non-blocking (no host sync in the hooks)", "csrc/transfer.cpp",
             "copy_extents(Direction::kToHost, src, host, /*non_blocking=*/host.pinned());  // I4 (M12): no host sync",
             "copy_extents(Direction::kToHost, src, host, /*non_blocking=*/false);"),
    Mutation("M13", "restores are non-blocking (no host sync in the hooks)", "csrc/transfer.cpp",
             "copy_extents(Direction::kToDevice, dev, host, /*non_blocking=*/host.pinned());  // I4 (M13): no host sync",
             "copy_extents(Direction::kToDevice, dev, host, /*non_blocking=*/false);"),
    Mutation("M14", "spill write: the copy stream waits for the producer (e_prod) before the I/O thread's copy",
             "csrc/transfer.cpp", "if (produced) produced->block(*stream);  // I1 (M14): src is complete on its stream"),
    Mutation("M15", "spill write: the I/O thread waits for its device->staging copy before pwrite", "csrc/transfer.cpp",
             "const bool staged = wait_event(copied);  // I2 (M15): this I/O thread's wait before pwrite, not the compute stream's (I4)",
             "const bool staged = true;"),
    Mutation("M16", "spill read: the copy stream waits for the allocation point (e_alloc)", "csrc/transfer.cpp",
             "if (allocated) allocated->block(*stream);  // I1 (M16): dst's block is ours from this point"),
    Mutation("M17", "spill read: staging is reused only after its staging->device copy completed", "csrc/transfer.cpp",
             "const bool copied_back = wait_event(*done);  // I2 (M17): the staging chunk is reused by the next transfer only after this copy",
             "const bool copied_back = true;"),
    Mutation("M18", "unpack waits for the spill read to finish", "csrc/scope.cpp",
             "h2d_done = read->wait();  // (M18) the restored bytes are complete before anyone reads them", "h2d_done = nullptr;"),
    Mutation("M19", "pack: no copy, event, side stream or pinned allocation while the current stream captures",
             "csrc/scope.cpp",
             "if (device_ok && (capturing || stream_capturing(x.device()))) {  // (M19) no transfer while capturing",
             "if (false) {"),
    Mutation("M20", "spill from host: the I/O thread reads a host copy only after its device->host copy completed",
             "csrc/transfer.cpp",
             "const bool host_copy_done = !d2h_done || wait_event(*d2h_done);  // I2 (M20): the host block holds the bytes before the file write reads it",
             "const bool host_copy_done = true;"),
    Mutation("M21", "pack: a view spanning most of its storage copies the whole storage (its siblings share it)",
             "csrc/scope.cpp", "return {0, storage_bytes};", "return span;"),
    Mutation("M22", "unpack: a record's one restore serves all its handles until each has unpacked",
             "csrc/records.cpp",
             "held_ = std::move(restored);  // (M22) later handles of this record reuse this restore instead of copying again"),
    Mutation("M23", "pack: a record saved again by a later layer moves to that layer's prefetch group",
             "csrc/scope.cpp", "records_.regroup(record, open_group_, next_seq_++, epoch_);  // (M23) saved again by a later layer"),
    Mutation("M24", "pack: by default a save shares a record's copy only when the same node made both saves (each save "
             "restores the bytes it had at its own save)",
             "csrc/records.cpp",
             "if (!share_copies) return false;  // (M24) any code may have run since the copy: this save gets its own"),
    Mutation("M25", "restore: the restored block is held, not tagged in the allocator (a tagged block's free "
             "raises after a sticky device error: std::terminate)",
             "csrc/transfer.cpp",
             "uses.hold_restore(dev.storage(), order.done, compute);  // I1 (M6, M25): the copy writes it on H; held, never tagged",
             "impl.recordDataPtrOnStream(dev.storage().data_ptr(), copy_stream);"),
    Mutation("M26", "exit: a source whose copy still runs is let go when the copy is done (the SourceReaper), not at "
             "a later call or in the destructor",
             "csrc/scope.cpp",
             "side_uses_.hand_off_sources(SourceReaper::instance(), capturing_device);  // (M26) let go at copy speed"),
]

_SOURCES = ("CMakeLists.txt", "csrc", "ops", "tests/device/emu")


def _run(cmd: list[str], env: dict[str, str], timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def _env() -> dict[str, str]:
    bindir = str(Path(sys.executable).parent)
    return dict(os.environ, PATH=f"{bindir}{os.pathsep}{os.environ.get('PATH', '')}")


def _copy_sources(src_dir: Path) -> None:
    """Makes the scratch copy equal to the checkout. Only files whose bytes differ are rewritten, with a fresh
    mtime, so the incremental build recompiles exactly what changed (restoring an older mtime would leave a mutant
    object file in place)."""
    for name in _SOURCES:
        src = ROOT / name
        files = [p for p in src.rglob("*") if p.is_file()] if src.is_dir() else [src]
        for path in files:
            if "__pycache__" in path.parts:
                continue
            dst = src_dir / path.relative_to(ROOT)
            data = path.read_bytes()
            if not dst.exists() or dst.read_bytes() != data:
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.write_bytes(data)


def _apply(src_dir: Path, m: Mutation) -> None:
    path = src_dir / m.file
    lines = path.read_text().splitlines(keepends=True)
    hits = [i for i, line in enumerate(lines) if line.strip() == m.line]
    if len(hits) != 1:
        raise SystemExit(f"{m.id}: expected exactly one line `{m.line}` in {m.file}, found {len(hits)}; "
                         "update MUTATIONS in scripts/mutation_check.py to the current source")
    i = hits[0]
    indent = lines[i][: len(lines[i]) - len(lines[i].lstrip())]
    lines[i] = f"{indent}{m.replacement}\n" if m.replacement else "\n"  # keep line numbers
    path.write_text("".join(lines))


def _build(src_dir: Path, build_dir: Path, env: dict[str, str]) -> Path:
    if not (build_dir / "CMakeCache.txt").exists():
        gen = ["-G", "Ninja"] if shutil.which("ninja", path=env["PATH"]) else []
        done = _run(["cmake", "-S", str(src_dir), "-B", str(build_dir), *gen, f"-DHSOFFLOAD_PYTHON={sys.executable}"],
                    env)
        if done.returncode != 0:
            raise SystemExit(f"configure failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    done = _run(["cmake", "--build", str(build_dir), "--target", "hsoffload"], env)
    if done.returncode != 0:
        raise SystemExit(f"build failed:\n{done.stdout[-3000:]}{done.stderr[-3000:]}")
    return build_dir / "libhsoffload.so"


def _suite(library: Path, env: dict[str, str]) -> tuple[int, list[str], str]:
    """Runs tests/device/emu against `library`; returns (exit code, failed test ids, output tail)."""
    run_env = dict(env, HSOFFLOAD_LIBRARY=str(library), HSOFFLOAD_EMU_CHILD="1")
    done = _run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rf", "tests/device/emu"], run_env,
                timeout=900)
    failed = re.findall(r"^FAILED (\S+)", done.stdout, flags=re.M)
    return done.returncode, failed, (done.stdout + done.stderr)[-3000:]


def _summary(names: list[str]) -> str:
    """Failed tests grouped by function (parametrized cases counted), rule tests first."""
    groups: dict[str, int] = {}
    for n in names:
        base = n.split("[")[0]
        groups[base] = groups.get(base, 0) + 1
    ordered = sorted(groups, key=lambda b: (not b.startswith("test_") or "round_trip" in b, b))
    parts = [f"`{b}`" + (f" ×{groups[b]}" if groups[b] > 1 else "") for b in ordered]
    return ", ".join(parts) if parts else "**none**"


def main() -> int:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="mutation ids to run (default: all)")
    parser.add_argument("--markdown", type=Path, help="also write the result table to this file")
    args = parser.parse_args()
    env = _env()
    src_dir, build_dir = SCRATCH / "src", SCRATCH / "build"
    _copy_sources(src_dir)
    t0 = time.monotonic()
    code, failed, tail = _suite(_build(src_dir, build_dir, env), env)
    if code != 0:
        logger.error("the unmutated build fails tests/device/emu; fix that first:\n%s", tail)
        return 2
    logger.info("baseline: tests/device/emu passes against the unmutated build (%.0f s)", time.monotonic() - t0)
    rows, survivors = [], []
    for m in MUTATIONS:
        if args.only and m.id not in args.only:
            continue
        _copy_sources(src_dir)
        _apply(src_dir, m)
        t1 = time.monotonic()
        code, failed, tail = _suite(_build(src_dir, build_dir, env), env)
        names = [f.split("::")[-1] for f in failed]
        if code == 0 or not names:
            survivors.append(m.id)
            if code != 0:
                logger.error("%s: the suite failed without a test failure:\n%s", m.id, tail)
        rows.append((m, names))
        logger.info("%s %-62s -> %s (%.0f s)", m.id, m.rule, ", ".join(names) or "SURVIVED", time.monotonic() - t1)
    _copy_sources(src_dir)  # leave the scratch copy unmutated
    table = ["| id | rule | line removed or changed | tests that failed |", "|---|---|---|---|"]
    for m, names in rows:
        change = f"`{m.line}`" + (f" → `{m.replacement}`" if m.replacement else " deleted")
        table.append(f"| {m.id} | {m.rule} | {m.file}: {change} | {_summary(names)} |")
    text = "\n".join(table)
    print(text)
    if args.markdown:
        args.markdown.write_text(text + "\n")
    if survivors:
        logger.error("mutations no test caught: %s", ", ".join(survivors))
        return 1
    logger.info("every mutation was caught (%d), %.0f s in all", len(rows), time.monotonic() - t0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
