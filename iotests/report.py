#!/usr/bin/env python3
"""The comparison `iotests/run.sh` prints and writes: from a run's directory (results.tsv, one
`format test implementation status seconds` row per test run, and logs/, check's output of
each) the counts per format, every test that passes with qemu-img but not with vdisk with the
reason its diff shows, and, for --quick, the verdict against the expected lists.

    iotests/report.py --run DIR [--lists DIR] [--out FILE] [--quick [--update-expected]]
                      [--write-expected] [--seconds N] [--qemu VERSION] [--vdisk-version V]

It can be rerun on a kept run directory (run.sh prints its path), e.g. after changing the rules
below. Exit status: 0, or 1 when --quick finds a regression.
"""

import argparse
import collections
import datetime
import os
import re
import sys

sys.dont_write_bytecode = True  # no __pycache__ in the source tree
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from classify import classify, unused_reasons  # noqa: E402

FORMATS = ("qcow2", "raw")


def load(run):
    """{(fmt, test): {impl: (status, seconds, first)}}, sorted; `first` is the status of the
    first attempt of a test that was run twice (it failed or hung), else None."""
    results = {}
    with open(os.path.join(run, "results.tsv"), encoding="utf-8") as f:
        for line in f:
            fmt, test, impl, status, seconds, first = line.rstrip("\n").split("\t")
            results.setdefault((fmt, test), {})[impl] = (
                status, float(seconds), None if first == "-" else first)
    return collections.OrderedDict(sorted(results.items()))


def log_of(run, impl, fmt, test):
    try:
        with open(os.path.join(run, "logs", f"{impl}-{fmt}-{test}.log"), encoding="utf-8",
                  errors="replace") as f:
            return f.read()
    except OSError:
        return ""


def status(results, key, impl):
    return results[key].get(impl, ("missing",))[0]


def read_list(path):
    try:
        with open(path, encoding="utf-8") as f:
            return {line.strip() for line in f if line.strip() and not line.startswith("#")}
    except FileNotFoundError:
        return set()


def write_list(path, tests, qemu):
    """A list of tests, sorted (byte order, as `LC_ALL=C sort`), under a line naming the QEMU
    whose tests they are."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(f"# QEMU {qemu}\n")
        f.writelines(t + "\n" for t in sorted(tests))


def cell(text, width=150):
    """A table cell: one line, at most `width` characters, as code, pipes escaped."""
    text = " ".join(text.split())
    if len(text) > width:
        text = text[:width - 1] + "…"
    return "`" + text.replace("`", "'").replace("|", "\\|") + "`" if text else ""


def percent(part, whole):
    return f"{100 * part / whole:.0f}%" if whole else "—"


def header(args, results, form):
    date = datetime.date.today().isoformat()
    took = f", {args.seconds // 60} min {args.seconds % 60} s" if args.seconds else ""
    impls = sorted({impl for r in results.values() for impl in r})
    return [
        "# QEMU's iotests against vdisk",
        "",
        f"QEMU {args.qemu}'s `tests/qemu-iotests`, run by `iotests/run.sh` ({form}{took}, "
        f"{os.cpu_count()} cores, {date}) with {' and '.join(impls)} as QEMU_IMG_PROG; "
        f"`{args.vdisk_version}`. qemu-io, qemu-nbd, qemu-storage-daemon and qemu-system "
        "(tcg in place of the qtest accelerator) are QEMU's. See docs/testing.md.",
        "",
    ]


def hangs_and_panics(args, results, failures):
    """The first thing the table says: any test that hung (timed out, on either attempt) or
    where vdisk panicked, and the tests whose two attempts disagreed."""
    lines, flaky = [], []
    for (fmt, test), r in results.items():
        for impl, (st, _, first) in r.items():
            if st == "hang":
                lines.append(f"- **hang**: {fmt} {test} with {impl}, twice (killed after the "
                             "timeout)")
            elif first == "hang":
                second = st
                if impl == "vdisk" and st != "pass" and (fmt, test) in failures:
                    second += f" ({failures[(fmt, test)][0]})"
                lines.append(f"- **hang**: {fmt} {test} with {impl} on the first attempt; the "
                             f"second: {second}")
            if first and st == "pass":
                flaky.append(f"{fmt} {test} ({impl}: {first}, then pass)")
    for (fmt, test), (category, _, _) in failures.items():
        if category == "panic":
            lines.append(f"- **panic**: {fmt} {test} with vdisk")
    out = ["**Hangs and panics:** " + ("none." if not lines else ""), *lines, ""]
    if lines:
        out += ["Some VM tests hang now and then with the real qemu-img as with vdisk: under "
                "tcg, on a loaded machine, the tests that qtest's frozen clock keeps in step "
                "can race (see docs/testing.md). Each hang's processes were killed after the "
                "timeout and the test was run again.", ""]
    if flaky:
        out += ["A test that fails or hangs is run a second time, and the second result "
                "counts. These passed only on the second attempt: " + ", ".join(flaky) + ".",
                ""]
    return out


def full_report(args, results):
    """The table of the full (or a partial) form: both implementations side by side."""
    failures = collections.OrderedDict()  # (fmt, test) -> (category, detail, name too)
    for (fmt, test) in results:
        if status(results, (fmt, test), "qemu-img") == "pass" and \
                status(results, (fmt, test), "vdisk") != "pass":
            st = status(results, (fmt, test), "vdisk")
            failures[(fmt, test)] = classify(fmt, test, st, log_of(args.run, "vdisk", fmt, test))

    if args.write_expected:
        for entry in unused_reasons():
            print(f"warning: iotests/reasons.txt: no failure matched {entry}", file=sys.stderr)
    out = header(args, results, "full form" if args.write_expected else "partial run")
    out += hangs_and_panics(args, results, failures)
    out += ["| format | tests run | pass with qemu-img | of those, pass with vdisk | % |",
            "| --- | ---: | ---: | ---: | ---: |"]
    summary = []
    for fmt in FORMATS:
        keys = [k for k in results if k[0] == fmt]
        if not keys:
            continue
        ran = sum(1 for k in keys if status(results, k, "qemu-img") not in ("notrun", "missing"))
        base = [k for k in keys if status(results, k, "qemu-img") == "pass"]
        both = [k for k in base if status(results, k, "vdisk") == "pass"]
        out.append(f"| {fmt} | {ran} | {len(base)} | {len(both)} | "
                   f"{percent(len(both), len(base))} |")
        summary.append(f"{fmt}: vdisk passes {len(both)} of the {len(base)} tests qemu-img "
                       f"passes ({percent(len(both), len(base))})")

    by_category = collections.Counter()
    name_too = 0
    for (fmt, _), (reason, _, name) in failures.items():
        # A reason read by hand may add "; also ..." to its main one, which is its category.
        by_category[(reason.split(";")[0], fmt)] += 1
        name_too += name
    categories = sorted({c for c, _ in by_category},
                        key=lambda c: (-sum(by_category[(c, f)] for f in FORMATS), c))
    out += ["", "## Failures by reason", "",
            "The reason is the first of the differences its diff shows, in this order: hang, "
            "panic, wrong data, a missing subcommand or option, input forms (json:, protocols, "
            "encryption), behaviour, then wording. \"program name\" alone means the test "
            "fails only because vdisk names itself `vdisk:` where qemu-img says `qemu-img:`; "
            f"{name_too} of the other failing tests show that difference too (marked ✱).", "",
            "| reason | qcow2 | raw |", "| --- | ---: | ---: |"]
    for c in categories:
        out.append(f"| {c} | {by_category[(c, 'qcow2')]} | {by_category[(c, 'raw')]} |")
    out += ["", "## Every test that passes with qemu-img and fails with vdisk", "",
            "| format | test | reason | first difference (vdisk's output, or what it lacks) |",
            "| --- | --- | --- | --- |"]
    for (fmt, test), (category, detail, name) in failures.items():
        out.append(f"| {fmt} | {test} | {category}{' ✱' if name else ''} | {cell(detail)} |")

    odd = [f"{fmt} {test}" for (fmt, test) in results
           if status(results, (fmt, test), "vdisk") == "pass"
           and status(results, (fmt, test), "qemu-img") not in ("pass", "missing")]
    not_base = collections.defaultdict(list)
    for (fmt, test) in results:
        st = status(results, (fmt, test), "qemu-img")
        if st in ("fail", "hang"):
            not_base[fmt].append(test if st == "fail" else f"{test} (hang)")
    out += ["", "## Not counted", "",
            "Tests that fail with the real qemu-img here too, their logs in the run's "
            "directory: mostly VM tests that need qtest's frozen virtual clock (under tcg it "
            "runs: block jobs race the test, snapshots record VM time, throttling and "
            "clock_step fail), and messages Debian's qemu-img words otherwise than the "
            "upstream reference output:", ""]
    out += [f"- {fmt}: {' '.join(tests)}" for fmt, tests in not_base.items()]
    if odd:
        out += ["", "Passing with vdisk but not with qemu-img: " + ", ".join(odd) + "."]
    return out, summary


def quick_report(args, results):
    """CI's verdict: the expected tests that failed (regressions) and the new passes."""
    regressions, new, lines = [], collections.defaultdict(list), []
    for fmt in FORMATS:
        expected = read_list(os.path.join(args.lists, f"expected-{fmt}.txt"))
        for (f, test) in results:
            if f != fmt:
                continue
            st = status(results, (f, test), "vdisk")
            if test in expected and st != "pass":
                category, detail, _ = classify(fmt, test, st,
                                               log_of(args.run, "vdisk", fmt, test))
                regressions.append((fmt, test, st, category, detail))
            elif test not in expected and st == "pass":
                new[fmt].append(test)
    passed = collections.Counter(k[0] for k, r in results.items()
                                 if r.get("vdisk", ("",))[0] == "pass")
    out = header(args, results, "quick form")
    out += hangs_and_panics(args, results, {
        (fmt, test): (category, detail, False)
        for fmt, test, _, category, detail in regressions})
    out += ["| format | pass with vdisk | regressions | new passes |",
            "| --- | ---: | ---: | ---: |"]
    for fmt in FORMATS:
        if any(k[0] == fmt for k in results):
            out.append(f"| {fmt} | {passed[fmt]} | "
                       f"{sum(1 for r in regressions if r[0] == fmt)} | {len(new[fmt])} |")
    if regressions:
        out += ["", "## Regressions: expected to pass, failed", "",
                "| format | test | status | reason | first difference |",
                "| --- | --- | --- | --- | --- |"]
        out += [f"| {fmt} | {test} | {st} | {category} | {cell(detail)} |"
                for fmt, test, st, category, detail in regressions]
    if any(new.values()):
        out += ["", "## New passes (add them: `iotests/run.sh --quick --update-expected`)", ""]
        out += [f"- {fmt}: {' '.join(tests)}" for fmt, tests in new.items() if tests]
        if args.update_expected:
            for fmt, tests in new.items():
                path = os.path.join(args.lists, f"expected-{fmt}.txt")
                write_list(path, read_list(path) | set(tests), args.qemu)
            out.append("\n(added to the expected lists)")
    n_new = sum(len(t) for t in new.values())
    summary = [f"{len(regressions)} regression{'' if len(regressions) == 1 else 's'} "
               f"(expected to pass, failed twice), {n_new} new pass{'' if n_new == 1 else 'es'}"]
    return out, summary, bool(regressions)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", required=True, help="the run's directory")
    p.add_argument("--lists", default=os.path.dirname(os.path.abspath(__file__)),
                   help="where expected-<fmt>.txt are")
    p.add_argument("--out", help="write the table here (default: stdout only)")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--update-expected", action="store_true")
    p.add_argument("--write-expected", action="store_true",
                   help="rewrite expected-<fmt>.txt (the tests vdisk passed) and "
                   "baseline-<fmt>.txt (the tests qemu-img passed)")
    p.add_argument("--seconds", type=int, default=0, help="how long the run took")
    p.add_argument("--qemu", default="?", help="QEMU's version")
    p.add_argument("--vdisk-version", default="vdisk")
    args = p.parse_args()

    results = load(args.run)
    failed = False
    if args.quick:
        out, summary, failed = quick_report(args, results)
    else:
        out, summary = full_report(args, results)
        if args.write_expected:
            # expected-*: what vdisk passes; baseline-*: what the real qemu-img passes, the
            # tests --quick runs (the others cannot pass here, and some hang).
            for fmt in FORMATS:
                for name, impl in (("expected", "vdisk"), ("baseline", "qemu-img")):
                    write_list(os.path.join(args.lists, f"{name}-{fmt}.txt"),
                               [t for (f, t), r in results.items()
                                if f == fmt and r.get(impl, ("",))[0] == "pass"], args.qemu)
    text = "\n".join(out) + "\n"
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            f.write(text)
    print(text)
    for line in summary:
        print(line, file=sys.stderr)
    if args.out:
        print(f"table written to {args.out}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
