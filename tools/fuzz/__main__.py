"""``python -m tools.fuzz``: fuzz the targets, replay the corpus, rewrite the seeds.

    run [TARGET ...] --seconds S --seed N   each target for S seconds in its own process (--jobs at once);
                                            a summary line per target; exit 1 on a violation
    replay [TARGET ...] [--slack K]         every committed input (or --corpus DIR's) once; exit 1 on a violation
    seeds                                   rewrite the seed-* inputs of corpus/ (tools/fuzz/seeds.py)

A fuzzing process (``_worker``) caps its address space at 2 GiB, runs torch on
one thread, instruments the target's packages for coverage, and hands
libFuzzer two corpus directories: a scratch one it adds new inputs to (under
``_build/fuzz/``, not committed) and the committed ``corpus/<target>/``.
A violating input is written to ``_build/fuzz/<target>/crash-*`` (or
``timeout-*`` past libFuzzer's wall-clock timeout); commit it to the corpus
with its fix.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
CORPUS = HERE / "corpus"
REPO = HERE.parents[1]
BUILD = REPO / "_build" / "fuzz"
NAMES = ("gguf", "pretrained", "tokenizer", "sampling")
WALL_TIMEOUT_S = 10  # libFuzzer's -timeout: a hang backstop; the 1 s contract is on CPU time


def _prepare_process() -> None:
    """What a process that runs inputs needs first: the address-space cap, one torch thread."""
    from .contract import limit_address_space

    limit_address_space()
    import torch

    torch.set_num_threads(1)


def _worker(args) -> None:
    """Fuzz one target in this process with atheris (libFuzzer); never returns."""
    _prepare_process()
    import atheris

    with atheris.instrument_imports(include=["pagedkv", "jinja2"]):
        import jinja2.sandbox  # noqa: F401
        import pagedkv.engine  # noqa: F401
        import pagedkv.model  # noqa: F401
    from .contract import Violation, timed
    from .targets import TARGETS

    target = TARGETS[args.target]
    committed = CORPUS / target.name
    for seed in sorted(committed.glob("seed-*")):  # warm the lazy imports before any input is timed
        try:
            target.run(seed.read_bytes())
        except Violation:
            pass  # libFuzzer replays the corpus first and reports it
    scratch = Path(args.scratch)
    scratch.mkdir(parents=True, exist_ok=True)
    artifacts = BUILD / target.name
    artifacts.mkdir(parents=True, exist_ok=True)
    corpora = [str(scratch)] if args.fresh else [str(scratch), str(committed)]
    flags = [sys.argv[0], *corpora, f"-seed={args.seed}", f"-max_total_time={args.seconds}",
             f"-timeout={WALL_TIMEOUT_S}", "-rss_limit_mb=2048", f"-max_len={target.max_len}",
             f"-artifact_prefix={artifacts}/", "-print_final_stats=1"]
    dictionary = HERE / "dicts" / f"{target.name}.dict"
    if dictionary.exists():
        flags.append(f"-dict={dictionary}")
    seen = set()

    def one_input(data: bytes) -> None:
        try:
            timed(target.run, data)
        except Violation as e:
            if not args.keep_going:
                raise  # libFuzzer writes the input to crash-* and stops
            key = _signature(e)
            if key not in seen:  # one artifact per kind of violation, then fuzz on
                seen.add(key)
                path = artifacts / f"crash-{hashlib.sha1(data).hexdigest()}"
                path.write_bytes(data)
                print(f"VIOLATION {key}: {e}\n  input: {path}", flush=True)

    atheris.Setup(flags, one_input)
    atheris.Fuzz()


def _signature(violation) -> str:
    """What kind of violation: the escaped exception's type and the deepest frame it passed through."""
    cause = violation.__cause__
    if cause is None:
        return str(violation).split(" (", 1)[0][:60]
    tb, where = cause.__traceback__, "?"
    while tb is not None:
        where = f"{Path(tb.tb_frame.f_code.co_filename).name}:{tb.tb_lineno}"
        tb = tb.tb_next
    kind = "unnamed" if "names none of" in str(violation) else "escaped"
    return f"{kind} {type(cause).__name__} at {where}"


_DONE = re.compile(r"#(\d+)\s+DONE\s+cov: (\d+) ft: (\d+) corp: (\d+)/(\S+)")
_PULSE = re.compile(r"#(\d+)\s+\w+\s+cov: (\d+) ft: (\d+) corp: (\d+)/(\S+)")


def summarize(name: str, log: str, rc: int, seconds: float) -> tuple[bool, str]:
    """(ok, one summary line) from a worker's libFuzzer output."""
    done = _DONE.findall(log) or _PULSE.findall(log)
    execs = re.search(r"stat::number_of_executed_units: (\d+)", log)
    n = int(execs.group(1)) if execs else int(done[-1][0]) if done else 0
    cov = f"coverage {done[-1][1]} edges, {done[-1][2]} features, corpus {done[-1][3]} inputs" if done else "no stats"
    kinds = re.findall(r"^VIOLATION (.*?): ", log, re.M)
    if rc == 0 and not kinds:
        return True, f"{name}: {n:,} executions in {seconds:.0f} s, {cov}; no violation"
    if rc == 0:
        return False, f"{name}: {n:,} executions in {seconds:.0f} s, {cov}; {len(kinds)} kinds of violation: " + \
            "; ".join(kinds)
    artifact = re.search(r"Test unit written to (\S+)", log)
    why = re.search(r"(Violation: .*|ERROR: libFuzzer: .*)", log)
    return False, (f"{name}: VIOLATION after {n:,} executions ({why.group(1) if why else f'exit {rc}'}); "
                   f"input: {artifact.group(1) if artifact else 'not written'}")


def _start(name: str, args) -> tuple[subprocess.Popen, Path, float]:
    """Start one target's worker, its output going to ``_build/fuzz/<name>.log``."""
    cmd = [sys.executable, "-m", "tools.fuzz", "_worker", name, "--seconds", str(args.seconds),
           "--seed", str(args.seed)]
    if args.fresh:  # a short run starts from the seeds and the fixed violations (the replay test has the rest)
        scratch = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=BUILD))
        for f in (CORPUS / name).iterdir():
            if f.name.startswith(("seed-", "hostile-", "crash-")):
                shutil.copy(f, scratch / f.name)
        cmd.append("--fresh")
    else:
        scratch = BUILD / name / "corpus"
    cmd += ["--scratch", str(scratch)] + (["--keep-going"] if args.keep_going else [])
    with (BUILD / f"{name}.log").open("w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    return proc, scratch, time.monotonic()


def run(args) -> int:
    """Each target in its own process, ``args.jobs`` at a time; a summary line per target, in order."""
    BUILD.mkdir(parents=True, exist_ok=True)
    names, ok_all = list(args.targets or NAMES), True
    for i in range(0, len(names), args.jobs):
        batch = [(name, *_start(name, args)) for name in names[i:i + args.jobs]]
        for name, proc, scratch, start in batch:
            rc = proc.wait()
            log = (BUILD / f"{name}.log").read_text(errors="replace")
            ok, line = summarize(name, log, rc, time.monotonic() - start)
            if args.fresh:
                shutil.rmtree(scratch, ignore_errors=True)
            print(line, flush=True)
            if not ok:
                print("\n".join(log.splitlines()[-40:]), file=sys.stderr)
            ok_all &= ok
    return 0 if ok_all else 1


def replay(targets, slack: float = 1.0, corpus: Path = CORPUS) -> dict:
    """Every input of ``targets`` in ``corpus`` once: {target: {"inputs", "violations", "slowest"}}."""
    _prepare_process()
    from .contract import LIMIT_S, Violation, timed, wall_clock_alarm
    from .targets import TARGETS

    report = {}
    for name in targets:
        target, files = TARGETS[name], sorted(f for f in (corpus / name).iterdir() if f.is_file())
        for f in files:  # warm the lazy imports (safetensors, jinja2, ...) before any input is timed
            try:
                target.run(f.read_bytes())
            except Violation:
                pass
        violations, times = [], []
        for f in files:
            try:
                with wall_clock_alarm(WALL_TIMEOUT_S):
                    times.append((timed(target.run, f.read_bytes(), LIMIT_S * slack), f.name))
            except Violation as e:
                violations.append(f"{name}/{f.name}: {e}")
        times.sort(reverse=True)
        report[name] = {"inputs": len(files), "violations": violations,
                        "slowest": [f"{f} {s:.3f} s" for s, f in times[:3]]}
    return report


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.fuzz")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run")
    p.add_argument("targets", nargs="*", default=[])
    p.add_argument("--seconds", type=int, default=10)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--jobs", type=int, default=1, help="targets fuzzed at once (one core each)")
    p.add_argument("--fresh", action="store_true",
                   help="a new scratch dir holding the seeds and fixed violations only (not cov-* inputs)")
    p.add_argument("--keep-going", action="store_true",
                   help="on a violation, write the input (one per kind of violation) and fuzz on")
    p = sub.add_parser("replay")
    p.add_argument("targets", nargs="*", default=[])
    p.add_argument("--slack", type=float, default=1.0, help="multiply the 1 s limit (a loaded machine)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--corpus", type=Path, default=CORPUS,
                   help="a directory of <target>/ input folders (default: the committed corpus)")
    sub.add_parser("seeds")
    p = sub.add_parser("_worker")
    p.add_argument("target", choices=NAMES)
    p.add_argument("--seconds", type=int, required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--scratch", required=True)
    p.add_argument("--keep-going", action="store_true")
    p.add_argument("--fresh", action="store_true", help="fuzz from --scratch alone, not the committed corpus")
    args, _ = parser.parse_known_args(argv)
    unknown = sorted(set(getattr(args, "targets", [])) - set(NAMES))
    if unknown:
        parser.error(f"unknown targets {unknown}; the targets are {', '.join(NAMES)}")
    if args.command == "_worker":
        _worker(args)
    if args.command == "run":
        return run(args)
    if args.command == "seeds":
        from .seeds import write_seeds

        for line in write_seeds(CORPUS):
            print(line)
        return 0
    report = replay(args.targets or list(NAMES), args.slack, args.corpus)
    if args.json:
        print(json.dumps(report))
    else:
        for name, r in report.items():
            print(f"{name}: {r['inputs']} inputs, {len(r['violations'])} violations; slowest {', '.join(r['slowest'])}")
            for v in r["violations"]:
                print("  " + v)
    return 0 if not any(r["violations"] for r in report.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
