"""Why a test failed with vdisk: a reason read from the diff between the test's reference
output and vdisk's (check prints the diff into the test's log).

The reason is the first rule below that matches the differences left once vdisk's own name is
set aside (QEMU's tools name themselves after argv[0]; vdisk still says `vdisk:` where the
reference says `qemu-img:`). A test whose diff is only that is "program name". The rules are
ordered from what matters most to the fixing work (wrong data) to what matters least (wording).
"""

import difflib
import re

NAME = re.compile(r"^vdisk(?=: )")


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
        renamed = [NAME.sub("qemu-img", line) for line in new]
        name = name or renamed != new
        matcher = difflib.SequenceMatcher(a=old, b=renamed, autojunk=False)
        for op, a0, a1, b0, b1 in matcher.get_opcodes():
            if op != "equal":
                removed += old[a0:a1]
                added += new[b0:b1]
    return removed, added, name


def first(lines, pattern):
    """The first line matching `pattern`, and its match."""
    for line in lines:
        m = re.search(pattern, line)
        if m:
            return line, m
    return None, None


# (reason, pattern, where): the first rule whose pattern matches a line of vdisk's output
# ("added"), of the reference ("removed") or of either ("any") gives the reason; a reason
# may use the match's groups. Reasons name the missing feature so that counts add up by feature.
RULES = [
    ("panic", r"panicked at", "added"),
    ("wrong data", r"Pattern verification failed|Content mismatch at", "added"),
    ("missing subcommand {1}", r"unrecognized subcommand '([^']+)'", "added"),
    ("missing option {1}", r"unexpected argument '(--?[^' =]+)", "added"),
    ("missing option {1}", r"(?:unknown|invalid|unsupported) option '?(--?[\w-]+)", "added"),
    ("qcow2 encryption (luks)", r"encrypt|luks|secret0|--object secret", "any"),
    ("json: file names", r"json:\{", "added"),
    ("protocol {1}", r"(nbd\+unix://|nbd://|null-co://|blkdebug:|blkverify:|file:|"
                     r"driver=[\w-]+)", "added"),
]


def classify(status, log):
    """(reason, detail, name_too): the reason of a failure, the first line that shows it and
    whether vdisk's name differed too (beside another reason)."""
    if status == "hang":
        return "hang", "killed after the timeout", False
    if status == "missing":
        return "not run by the harness", "", False
    hunks = diff_hunks(log)
    if not hunks:
        tail = [line for line in log.splitlines() if line.strip()][-1:]
        return "failed without output difference", " ".join(tail), False
    removed, added, name = changes(hunks)
    if not removed and not added:
        detail = next((line for _, new in hunks for line in new if NAME.match(line)), "")
        return "program name", detail, False
    for reason, pattern, where in RULES:
        lines = {"added": added, "removed": removed, "any": added + removed}[where]
        line, m = first(lines, pattern)
        if line is not None:
            return reason.format(*([m.group(0)] + list(m.groups()))), line, name
    detail = added[0] if added else "lacks: " + removed[0]
    messages = [line for line in added + removed if line.strip()]
    if messages and all(re.match(r"(qemu-img|vdisk): |Usage:|  ", line) for line in messages):
        return "message wording", detail, name
    return "different output", detail, name
