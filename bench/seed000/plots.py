"""PNG plots: per figure, bars per configuration normalised to QEMU (QEMU = 1.0)."""

import os

import matplotlib

matplotlib.use("Agg")  # files only, no display
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"QEMU": "#9e9e9e", "vdisk": "#1f77b4", "raw limit": "#b5d99c"}


def short(v, unit):
    """19110 -> '19.1k', for the QEMU bar's absolute value."""
    if v >= 10000:
        text = "%.1fk" % (v / 1000)
    elif v >= 100:
        text = "%.0f" % v
    else:
        text = "%.3g" % v
    return text + (" " + unit if unit else "")


def panel(ax, p):
    rows = [r for r in p.rows if r.qemu]
    n = len(rows)
    h = 0.26
    top = 0
    for i, r in enumerate(rows):
        y = n - 1 - i  # first row at the top, as in the table
        bars = [("QEMU", 1.0), ("vdisk", r.vdisk / r.qemu if r.vdisk is not None else None),
                ("raw limit", r.raw / r.qemu if r.raw is not None else None)]
        for j, (name, v) in enumerate(bars):
            if v is None:
                continue
            pos = y + (1 - j) * h
            ax.barh(pos, v, h, color=COLORS[name], label=name, edgecolor="white")
            text = ("%.2f" % v if name != "QEMU"
                    else "1 = " + short(r.qemu, r.unit or default_unit(p)))
            ax.text(v, pos, " " + text, va="center", fontsize=8,
                    fontweight="bold" if name == "vdisk" else "normal")
            top = max(top, v)
    ax.set_yticks(range(n))
    ax.set_yticklabels([r.label for r in rows][::-1], fontsize=9)
    ax.axvline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xlim(0, top * 1.3 if top else 1)
    ax.set_xlabel(p.ylabel + " (QEMU = 1.0)")
    ax.set_title(p.title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)


def default_unit(p):
    return "IOPS" if "IOPS" in p.ylabel else ""


def plot(section, path):
    panels = [p for p in section.panels if any(r.qemu for r in p.rows)]
    if not panels:
        return False
    height = max(2.5, 0.75 * max(len(p.rows) for p in panels) + 1.3)
    fig, axes = plt.subplots(1, len(panels), figsize=(7.5 * len(panels), height), squeeze=False)
    for ax, p in zip(axes[0], panels):
        panel(ax, p)
    fig.suptitle(section.title, fontsize=12, fontweight="bold", y=1 - 0.12 / height)
    # One legend for all panels, under the title, where it never covers a bar.
    handles, labels = axes[0][0].get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    fig.legend(unique.values(), unique.keys(), loc="upper center", ncol=3, fontsize=9,
               frameon=False, bbox_to_anchor=(0.5, 1 - 0.36 / height))
    fig.tight_layout(rect=(0, 0, 1, 1 - 0.6 / height))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_all(secs, directory):
    """Writes a PNG per section that has panels; returns {section key: file name}."""
    os.makedirs(directory, exist_ok=True)
    names = {}
    for sec in secs:
        name = sec.key + ".png"
        if plot(sec, os.path.join(directory, name)):
            names[sec.key] = name
    return names
