"""Why a test failed with vdisk: a reason read from the diff between the test's reference
output and vdisk's (check prints the diff into the test's log).

The reason is the first rule below that matches the differences left once vdisk's own name is
set aside (QEMU's tools name themselves after argv[0]; vdisk still says `vdisk:` where the
reference says `qemu-img:`). A test whose diff is only that is "program name". The rules are
ordered from what matters most to the fixing work (wrong data) to what matters least (wording).
"""

import ast
import difflib
import os
import re

NAME = re.compile(r"^vdisk(?=: )")
# The filters of common.filter that key on the name: with `qemu-img:`, _filter_qemu_img_check
# turns raw's refusal into the reference's success line.
NAMED_FILTERS = [("qemu-img: This image format does not support checks",
                  "No errors were found on the image.")]


def rename(line):
    """vdisk's line as the reference would show it had vdisk said `qemu-img:`."""
    line = NAME.sub("qemu-img", line)
    for said, filtered in NAMED_FILTERS:
        line = line.replace(said, filtered)
    return line


def diff_hunks(log):
    """The unified diff in check's output, as hunks of (removed-or-context, added-or-context)
    line lists: what the reference says, what vdisk printed."""
    hunks, old, new, in_diff = [], None, None, False
    for line in log.splitlines():
        if line.startswith("--- ") and not in_diff:
            in_diff = True
            continue
        if not in_diff or line.startswith("+++ "):
            continue
        if line.startswith("@@"):
            old, new = [], []
            hunks.append((old, new))
        elif old is None:
            continue
        elif line.startswith("-"):
            old.append(line[1:])
        elif line.startswith("+"):
            new.append(line[1:])
        elif line.startswith(" ") or line == "":
            old.append(line[1:])
            new.append(line[1:])
        else:
            # check's own lines after the diff ("Failures: ...", TAP) end it.
            break
    return hunks


def changes(hunks):
    """The lines removed and added once `vdisk:` reads `qemu-img:` (the added ones as vdisk
    printed them), and whether the name differed anywhere."""
    removed, added, name = [], [], False
    for old, new in hunks:
        renamed = [rename(line) for line in new]
        name = name or renamed != new
        matcher = difflib.SequenceMatcher(a=old, b=renamed, autojunk=False)
        for op, a0, a1, b0, b1 in matcher.get_opcodes():
            if op != "equal":
                removed += old[a0:a1]
                added += new[b0:b1]
    return removed, added, name


# A scratch path of the run as the reference outputs write it, and the stand-in's path.
SCRATCH = re.compile(r"/\S*?/scratch/(?:vdisk|qemu-img)/[\w.-]+-file-[\w.-]+/")
STAND_IN = re.compile(r"/\S*?/bin/qemu-img\b")
# Python tests: unittest's progress line, its separators and traceback frames say nothing of
# the cause; the tool's output is in the exception's box (┏ ┃ ┗, wrapped at the terminal's
# width).
NOISE = re.compile(r"^([.EFsx]+|=+|-+|Traceback .*|  File .*|    .*|\s*\^+|Ran \d+ tests.*|"
                   r"FAILED \(.*|OK|\s*)$")


def tidy(lines):
    """vdisk's output lines with the boxes of Python tests' exceptions joined into one line
    each, scratch paths written TEST_DIR/ and the stand-in's path qemu-img."""
    out, box = [], None
    for line in lines:
        text = line.strip()
        if text.startswith("┏"):
            box = []
        elif text.startswith("┗") and box is not None:
            # A line as wide as the widest was cut in a word; a shorter one at a space.
            width = max(map(len, box), default=0)
            out.append("".join(b + ("" if len(b) == width else " ") for b in box).strip())
            box = None
        elif box is not None and text.startswith("┃"):
            box.append(text[1:].strip())
        else:
            out.append(line)
    out = [STAND_IN.sub("qemu-img", SCRATCH.sub("TEST_DIR/", line)) for line in out]
    # A failed command of a Python test: the command and its output on one line.
    for i, line in enumerate(out):
        m = re.match(r"qemu\.utils\.VerboseProcessError: Command '(\(.*\))' returned", line)
        if m:
            try:
                command = " ".join(ast.literal_eval(m.group(1)))
            except (ValueError, SyntaxError):
                command = m.group(1)
            output = out[i + 1] if i + 1 < len(out) else ""
            short = command if len(command) <= 60 else command[:59] + "…"
            out[i] = f"{short} → {output}"
    return out


def first(lines, pattern):
    """The first line matching `pattern`, and its match."""
    for line in lines:
        m = re.search(pattern, line)
        if m:
            return line, m
    return None, None


# (reason, pattern, where): the first rule whose pattern matches a line of vdisk's output
# ("added"), of the reference ("removed") or of either ("any") gives the reason; a reason
# may use the match's groups. Reasons name the missing feature so that counts add up by
# feature; a missing command-line option is found by missing_option() between the first two.
RULES = [
    ("panic", r"panicked at", "added"),
    ("wrong data", r"Pattern verification failed", "added"),
    ("missing subcommand {1}", r"unrecognized subcommand '([^']+)'", "added"),
    ("options after the file names", r"\d+ values? required by '<FILE", "added"),
    ("missing create option {1}", r"Invalid parameter '([^']+)'", "added"),
    ("qcow2 encryption (luks)", r"encrypt|luks|LUKS|secret0|--object secret", "any"),
    ("json: file names", r"json:\{", "added"),
    ("protocol {1}", r"(nbd\+unix://|nbd://|null-co://|blkdebug:|blkverify:|file:)", "added"),
    ("create -f file (a protocol as the format)", r"Unknown file format 'file'", "added"),
    ("other formats (vdisk has raw and qcow2 only); here {1}", r"Unknown file format '(\w+)'",
     "added"),
    ("wrong data", r"Content mismatch at|Images differ", "added"),
    ("convert -p progress steps", r"^\s*\(\d+\.\d+/100%\)$", "any"),
]


def missing_option(lines):
    """("missing option [SUBCOMMAND ]OPTION", line) for clap's refusal of an option, naming the
    subcommand for short options (-c of rebase is not -c of convert), or None."""
    for i, line in enumerate(lines):
        m = re.search(r"unexpected argument '(--?[^' =]+)", line)
        if not m:
            continue
        option = m.group(1)
        if not option.startswith("--"):
            # clap's usage line names the subcommand, on a later line (or later on the same
            # line when a Python test's box was joined).
            usage = next((u for u in [line[m.end():]] + lines[i + 1:i + 8]
                          if re.search(r"Usage: \S+ \w", u)), "")
            sub = re.search(r"Usage: \S+ (\w+)", usage)
            option = f"{sub.group(1)} {option}" if sub else option
        return f"missing option {option}", line
    return None


def read_by_hand(path):
    """reasons.txt: `[FORMAT:]TEST | reason | text the diff shows`, one a line."""
    entries = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.strip() or line.startswith("#"):
                    continue
                key, reason, quote = (part.strip() for part in line.split("|", 2))
                formats, _, name = key.rpartition(":")
                entries.append((formats.split(",") if formats else ["qcow2", "raw"], name,
                                reason, quote))
    except FileNotFoundError:
        pass
    return entries


# Reasons read by hand from the diffs, for failures the rules above cannot name (behaviour
# shown by values, not messages). Each holds only while its quoted text is in the diff, so a
# changed failure falls back to the rules instead of keeping a stale reason.
USED = set()
READ_BY_HAND = read_by_hand(os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                         "reasons.txt"))


def by_hand(fmt, test, lines):
    """The reason reasons.txt gives the test, if the text it quotes is still in `lines`:
    (reason, the line quoting it)."""
    for i, (formats, name, reason, quote) in enumerate(READ_BY_HAND):
        if name == test and fmt in formats:
            line = next((line for line in lines if quote in line), None)
            if line is not None:
                USED.add(i)
                return reason, line
    return None


def unused_reasons():
    """The entries of reasons.txt that no failure classified so far matched."""
    return [f"{name} | {reason}" for i, (_, name, reason, _) in enumerate(READ_BY_HAND)
            if i not in USED]


def classify(fmt, test, status, log):
    """(reason, detail, name_too): the reason of a failure, the first line that shows it and
    whether vdisk's name differed too (beside another reason)."""
    if status == "hang":
        return "hang", "killed after the timeout", False
    if status == "missing":
        return "not run by the harness", "", False
    if status == "notrun":
        # The test's own probe with vdisk failed (_require_working_luks, say): its message,
        # which run.sh appends to the log after check's "# SKIP" line.
        lines = log.splitlines()
        skip = next((i for i, line in enumerate(lines) if line.endswith("# SKIP")), len(lines))
        why = [line for line in lines[skip + 1:] if line.strip()
               and not line.startswith("killed ")] or [""]
        hand = by_hand(fmt, test, why)
        if hand:
            return hand[0], hand[1], False
        option = missing_option(why)
        if option:
            return option[0], option[1], False
        for reason, pattern, _ in RULES:
            line, m = first(why, pattern)
            if line is not None:
                return reason.format(*([m.group(0)] + list(m.groups()))), line, False
        return "not run with vdisk", why[0], False
    hunks = diff_hunks(log)
    if not hunks:
        tail = [line for line in log.splitlines() if line.strip()][-1:]
        return "failed without output difference", " ".join(tail), False
    removed, added, name = changes(hunks)
    added = tidy(added)
    name = name or any(NAME.match(line) for line in added)
    if not removed and not added:
        detail = next((line for _, new in hunks for line in new if NAME.match(line)), "")
        return "program name", detail, False
    hand = by_hand(fmt, test, added + removed)
    if hand:
        return hand[0], hand[1], name
    for i, (reason, pattern, where) in enumerate(RULES):
        if i == 3:
            option = missing_option(added)
            if option:
                return option[0], option[1], name
        lines = {"added": added, "removed": removed, "any": added + removed}[where]
        line, m = first(lines, pattern)
        if line is not None:
            return reason.format(*([m.group(0)] + list(m.groups()))), line, name
    telling = [line for line in added if not NOISE.match(line)]
    detail = telling[0] if telling else added[0] if added else "lacks: " + removed[0]
    messages = [line for line in added + removed if line.strip()]
    if messages and all(re.match(r"(qemu-img|vdisk): |Usage:|  ", line) for line in messages):
        return "message wording", detail, name
    return "different output", detail, name
