"""``python -m bench [--quick] [--only SCENARIO ...] [--baseline COMMIT] [--compiled]``: run the benchmarks.

Full mode writes ``bench/RESULTS.md`` (the recorded results); ``--quick`` (CI: keeps the
suite working, asserts no timing) uses short runs and writes
``bench/out/RESULTS-quick.md`` so it never overwrites the recorded results. ``--only``
runs some scenarios and writes ``bench/out/RESULTS-<names>.md`` unless ``--out`` says
otherwise. ``--baseline`` is the commit the previous engine is run from (a git worktree
the bench makes under its work directory and removes at the end); ``--compiled`` adds, in
the engine scenario, this tree with its request path compiled by mypyc (``common.Compiled``,
an experiment: it does not ship). Exit code 1 if a
scenario crashed, else 0 (targets missed are not failures).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import sys
import time
import traceback

from . import common as c
from .report import Section, render

SCENARIOS = ("overhead", "engine", "scheduling", "churn", "scale", "workers", "fleet", "protocols", "h2", "profile")


def _module(name: str):  # imported lazily: a scenario's import error is that scenario's failure
    import importlib

    return importlib.import_module(f"bench.{name}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="short runs (~3 min); writes bench/out/RESULTS-quick.md")
    ap.add_argument(
        "--only",
        action="append",
        choices=SCENARIOS,
        metavar="SCENARIO",
        help=f"run only this scenario (repeatable): {', '.join(SCENARIOS)}",
    )
    ap.add_argument("--out", help="where to write the markdown (default: see above)")
    ap.add_argument(
        "--baseline",
        default=c.BASELINE_COMMIT,
        metavar="COMMIT",
        help=f"the previous engine's commit (default {c.BASELINE_COMMIT}: the one before the engine work)",
    )
    ap.add_argument(
        "--compiled",
        action="store_true",
        help="the engine scenario also runs this tree with its hot modules compiled by mypyc (an experiment)",
    )
    ap.add_argument("--no-install", action="store_true", help="do not apt-get install missing tools")
    ap.add_argument(
        "--no-rt",
        action="store_true",
        help="never use real-time priority (chrt) for the light-load latency measurements",
    )
    args = ap.parse_args(argv)

    started = time.time()
    command = "python -m bench" + (
        " " + " ".join(shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:]))
        if (argv if argv is not None else sys.argv[1:])
        else ""
    )
    names = list(args.only) if args.only else [s for s in SCENARIOS if not (args.quick and s == "profile")]
    if args.out:
        out_path = c.Path(args.out)
    elif args.only:
        out_path = c.OUT / f"RESULTS-{'-'.join(names)}{'-quick' if args.quick else ''}.md"
    elif args.quick:
        out_path = c.OUT / "RESULTS-quick.md"
    else:
        out_path = c.BENCH / "RESULTS.md"

    c.OUT.mkdir(parents=True, exist_ok=True)
    work = c.OUT / ("work-quick" if args.quick else "work")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    nofile = c.raise_nofile()
    niced = False
    if not args.quick and os.geteuid() == 0:
        try:  # children inherit it: the bench's processes win CPU from other work on a shared box
            os.nice(-5)
            niced = True
        except OSError:
            pass
    tools, notes = c.find_tools(install=not args.no_install)
    baseline = c.Baseline(args.baseline, work / "baseline-src")
    compiled = c.Compiled(work / "compiled-src") if args.compiled else None
    ctx = c.Ctx(quick=args.quick, work=work, tools=tools, baseline=baseline, compiled=compiled)
    ctx.rt = not args.no_rt and c.rt_available()
    if not ctx.rt:
        ctx.note("no real-time priority (chrt): latency runs share the CPUs with whatever else runs")
    if niced:
        ctx.note(
            "the bench and every process it started ran at nice -5 (other work on this shared machine "
            "gets less of the CPU while it runs)"
        )
    for n in notes:
        ctx.note(n)
    if nofile < 25000:
        ctx.note(f"open-files limit is {nofile}: the 10,000-connection parts may be cut short")
    ctx.note(f"load average at start: {c.loadavg()} (other sessions share this machine)")
    c.log(f"scenarios: {', '.join(names)}; writing {out_path}")
    c.log(f"pinning: {c.pin_text(ctx)}")

    sections: list[Section] = []
    profile_md = None
    failed = False
    try:
        for name in names:
            t0 = time.monotonic()
            load_before = c.loadavg()
            c.log(f"=== {name} (load average {load_before})")
            try:
                result = _module(name).run(ctx)
            except Exception as exc:  # one scenario's crash must not lose the others
                failed = True
                traceback.print_exc()
                result = Section(name, f"{name}: failed", error=f"{type(exc).__name__}: {exc}")
            if isinstance(result, str):
                profile_md = result
            else:
                result.seconds = time.monotonic() - t0
                result.load = f"{load_before} before, {c.loadavg()} after"
                sections.append(result)
            c.log(f"=== {name} done in {time.monotonic() - t0:.1f}s")
            # write after every scenario: a long run that dies keeps what it measured
            out_path.parent.mkdir(parents=True, exist_ok=True)
            out_path.write_text(render(ctx, sections, command, started, profile_md))
    finally:
        baseline.remove()
        if compiled is not None:
            compiled.remove()
    c.log(f"wrote {out_path} in {time.time() - started:.0f}s")
    return 1 if failed else 0


if __name__ == "__main__":
    os.chdir(c.ROOT)
    sys.exit(main())
