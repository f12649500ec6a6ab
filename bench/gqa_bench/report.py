"""The markdown report and the T-sweep plot, rendered from a results object."""
from pathlib import Path

from . import config
from .errors import format_error
from .impls import FLOORS, IMPL_NAMES, NON_PEERS
from .shapes import HARNESS_SHAPE, SWEEP_HEADS, SWEEP_TOKENS, SWEEP_TS, shape_str


def _fmt_ms(x):
    if x is None:
        return "—"
    return f"{x:.4f}" if x < 100 else f"{x:.1f}"


def _fmt_tf(x):
    if x is None:
        return "—"
    if x >= 100:
        return f"{x:.0f}"
    return f"{x:.2f}" if x >= 1 else f"{x:.3g}"


def _fmt_rel(x):
    return "—" if x is None else f"{x:.2e}"


def _md_cell(s):
    return "" if s is None else str(s).replace("|", "\\|").replace("\n", " ")


def _groups(rows):
    """Rows by (shape, dtype, mode), in the order they were measured."""
    groups: dict = {}
    for r in rows:
        groups.setdefault((tuple(r["shape"]), r["dtype"], r["mode"]), []).append(r)
    return groups


def best_peer(group_rows):
    peers = [r for r in group_rows if r["impl"] not in NON_PEERS and r["error"] is None and r["ms"] is not None]
    return min(peers, key=lambda r: r["ms"]) if peers else None


def _ratio_line(group_rows) -> str:
    proj = next((r for r in group_rows if r["impl"] == "project"), None)
    peer = best_peer(group_rows)
    if peer is None:
        return "best peer: none ran"
    head = f"best peer: `{peer['impl']}` {_fmt_ms(peer['ms'])} ms"
    if proj is None or proj["ms"] is None:
        return head + "; project: no timing"
    ratio = peer["ms"] / proj["ms"]
    verdict = "project faster" if ratio > 1 else "peer faster"
    line = head + f"; project {_fmt_ms(proj['ms'])} ms; best-peer/project = **{ratio:.2f}×** ({verdict})"
    spread = round_ratios(proj, peer)
    if spread:
        line += f"; round by round {min(spread):.2f}×–{max(spread):.2f}× over {len(spread)} rounds"
    return line


def round_ratios(proj, peer):
    """peer ms / project ms of each round both rows were timed in (rows of --rounds), else []."""
    a, b = proj.get("rounds") or [], peer.get("rounds") or []
    return [y / x for x, y in zip(a, b) if x > 0] if len(a) == len(b) > 1 else []


# --------------------------------------------------------------------------
# Markdown sections, each a list of lines ending with a blank one
# --------------------------------------------------------------------------
def _header(result: dict, info: dict) -> list:
    comp = result["compile"]
    return [
        f"# Causal GQA benchmark: {result['gpu']}",
        "",
        f"torch {result['torch']}, CUDA {result['cuda']}, {result['date']}, "
        f"kernels sha256 `{result['source_sha256'][:16]}…`",
        "",
        "## Compile time (project extension, first call)",
        "",
        f"- cold: **{comp['cold_s']:.2f} s**, warm: **{comp['warm_s']:.2f} s**",
        *(f"- {line}" for line in info.get("compile_notes", [])),
        "",
    ]


def _floors(groups) -> list:
    """The project against the two floors at the harness shape."""
    lines = []
    for mode in config.MODES:
        g = groups.get((HARNESS_SHAPE, "float32", mode))
        if not g:
            continue
        ms = {r["impl"]: r["ms"] for r in g if (r["impl"] == "project" or r["impl"] in FLOORS) and r["ms"]}
        if "project" not in ms:
            lines.append(f"- {mode}: n/a (the project has no timing)")
            continue
        parts = [f"project {_fmt_ms(ms['project'])} ms"]
        for floor in FLOORS:
            if floor in ms:
                parts.append(f"{floor} {_fmt_ms(ms[floor])} ms (project = **{ms['project'] / ms[floor]:.2f}×**)")
        lines.append(f"- {mode}: " + ", ".join(parts))
    if not lines:
        return []
    return [
        f"## project against the floors at the harness shape {shape_str(HARNESS_SHAPE)} float32",
        "",
        "read_floor reads q, k and v once and writes o; empty_call allocates o and launches an empty "
        "kernel. harness mode times like KernelBench (256 MB L2 flush, events around one call).",
        "",
        *lines,
        "",
    ]


def _sweep(groups, sweep: dict) -> list:
    """TFLOP/s per implementation and T, one table per dtype."""
    if not sweep:
        return []
    out = [
        f"## Sweep: TFLOP/s (back_to_back), B·T={SWEEP_TOKENS}, Hq={SWEEP_HEADS[0]}, Hkv={SWEEP_HEADS[1]}, D={SWEEP_HEADS[2]}",
        "",
    ]
    for dtype_name, shapes in sweep.items():
        present = [s for s in shapes if (tuple(s), dtype_name, "back_to_back") in groups]
        if not present:
            continue
        out.append(f"**{dtype_name}**")
        out.append("")
        out.append("| impl | " + " | ".join(f"T={s[1]}" for s in present) + " |")
        out.append("|---|" + "---:|" * len(present))
        impls_here = []
        for s in present:
            for r in groups[(tuple(s), dtype_name, "back_to_back")]:
                if r["impl"] not in impls_here and r["impl"] not in FLOORS:
                    impls_here.append(r["impl"])
        for impl in impls_here:
            cells = []
            for s in present:
                r = next((x for x in groups[(tuple(s), dtype_name, "back_to_back")] if x["impl"] == impl), None)
                cells.append(_fmt_tf(r["tflops"]) if r and r["error"] is None else "—")
            out.append(f"| {impl} | " + " | ".join(cells) + " |")
        out.append("")
    return out


def _results(groups, means: dict, brief: bool) -> list:
    """One section per (shape, dtype, mode): the ratio line, then (unless brief) the table."""
    out = [
        "## Results",
        "",
        "Ratio = best peer ms / project ms (>1 means the project is faster); best peer = fastest "
        "error-free impl other than project, empty_call, read_floor and reference_loops.",
        "",
    ]
    for (shape, dtype_name, mode), g in groups.items():
        out.append(f"### {shape_str(shape)} {dtype_name} {mode}")
        out.append("")
        out.append(_ratio_line(g))
        project_plan = next((r.get("plan") for r in g if r["impl"] == "project" and r.get("plan")), None)
        if project_plan:
            out.append(f"project plan: `{project_plan}`")
        out.append("")
        if brief and tuple(shape) != HARNESS_SHAPE:
            continue
        harness = mode == "harness"
        if harness:
            out.append("| impl | ms (median) | ms (mean) | TFLOP/s | rel_err | error |")
            out.append("|---|---:|---:|---:|---:|---|")
        else:
            out.append("| impl | ms (median) | rounds (ms) | TFLOP/s | rel_err | error |")
            out.append("|---|---:|---:|---:|---:|---|")
        for r in g:
            cells = [r["impl"], _fmt_ms(r["ms"])]
            if harness:
                cells.append(_fmt_ms(means.get((tuple(shape), dtype_name, r["impl"], mode))))
            else:
                cells.append(", ".join(_fmt_ms(x) for x in r.get("rounds") or []) or "—")
            cells += [_fmt_tf(r["tflops"]), _fmt_rel(r["rel_err"]), _md_cell(r["error"])]
            out.append("| " + " | ".join(cells) + " |")
        out.append("")
    return out


def _method(info: dict) -> list:
    return [
        "## Method",
        "",
        "- FLOPs = 4·B·Hq·T²·D/2 (causal). Inputs are fresh `torch.randn` in the row's dtype; "
        "q is [B,T,Hq,D], k/v are [B,T,Hkv,D].",
        "- Correctness is checked once before timing: rel_err = ‖out−ref‖/‖ref‖ in float64 against a float64 "
        f"reference; tolerance {config.TOLERANCE['float32']:g} (float32) and {config.TOLERANCE['bfloat16']:g} (bfloat16/float16). "
        "A wrong or NaN result is reported as an error and not timed. empty_call and read_floor are not checked (they are floors).",
        f"- Where B·Hq·T²·8 bytes exceed {config.FULL_REFERENCE_LIMIT // 2**30} GiB, the reference covers only query rows "
        f"0–{config.SLICE_ROWS - 1} and the last {config.SLICE_ROWS} (all heads).",
        f"- harness: KernelBench's cuda_event method: {config.HARNESS_WARMUP} warm-ups, then {config.HARNESS_TRIALS} trials of "
        "synchronize, 256 MB L2 flush, event, call, event, synchronize; median is the row's ms, mean is shown too. "
        f"reference_loops (≈100 ms a call) uses {config.LOOPS_WARMUP} warm-up and {config.LOOPS_TRIALS} trials.",
        f"- back_to_back: median of {info.get('do_bench_note', 'triton.testing.do_bench')} (return_mode='median').",
        f"- backward: forward + backward (inputs that require grad, a fixed output gradient) minus the forward, "
        f"medians by the back_to_back method; TFLOP/s count {config.BACKWARD_FLOP_FACTOR:g}x the forward's FLOPs; rel_err is "
        "left empty (gradients are checked by the tests, not by the benchmark).",
        f"- back_to_back and backward in {info.get('rounds', 1)} round(s): each round times every implementation of the "
        "shape once, in turn; with more than one, a row's ms is the median of its rounds' medians, and the ratio line "
        "gives the ratio of each round.",
        f"- graph: {config.GRAPH_CALLS} calls captured in one CUDA graph after side-stream warm-up; median of "
        f"{config.GRAPH_REPLAYS} timed replays divided by {config.GRAPH_CALLS} (reference_loops: {config.LOOPS_GRAPH_CALLS} calls, "
        f"{config.LOOPS_GRAPH_REPLAYS} replays). No L2 flush between calls.",
        "- SDPA and flex get [B,H,T,D] transposed views of the inputs (part of the timed call), the output is "
        "transposed back; sdpa_expand_efficient's repeat_interleave is part of the timed call; flex's block mask "
        "is built once per shape outside the timing; torch.compile uses dynamic=False.",
        f"- An impl whose estimated memory exceeds {int(config.MEMORY_FRACTION * 100)}% of free GPU memory is skipped "
        "with an error; out-of-memory is an error too.",
        *(f"- {line}" for line in info.get("extra_notes", [])),
        "",
    ]


def render_md(result: dict, means: dict, info: dict, brief: bool = False) -> str:
    """The report: compile time, floors, sweep tables, per-configuration results, method.

    means: harness-mode mean ms by (shape, dtype, impl, mode); info: compile_notes, extra_notes,
    do_bench_note and sweep_shapes. brief keeps only the ratio lines outside the harness shape.
    """
    groups = _groups(result["rows"])
    out = (_header(result, info) + _floors(groups) + _sweep(groups, info.get("sweep_shapes", {}))
           + _results(groups, means, brief) + _method(info))
    return "\n".join(out)


def render_plot(result: dict, sweep_shapes: dict, path: Path) -> bool:
    """TFLOP/s against T for each swept dtype, written to path; False when there is no sweep data."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = _groups(result["rows"])
    dtypes = [d for d, shapes in sweep_shapes.items() if any((tuple(s), d, "back_to_back") in groups for s in shapes)]
    if not dtypes:
        return False
    fig, axes = plt.subplots(1, len(dtypes), figsize=(6.5 * len(dtypes), 4.8), squeeze=False)
    markers = "os^vD<>px*h"
    for ax, dtype_name in zip(axes[0], dtypes):
        shapes = sweep_shapes[dtype_name]
        impls = [i for i in IMPL_NAMES if i not in NON_PEERS or i == "project"]
        for n, impl in enumerate(impls):
            xs, ys = [], []
            for s in shapes:
                for r in groups.get((tuple(s), dtype_name, "back_to_back"), []):
                    if r["impl"] == impl and r["error"] is None and r["tflops"] is not None:
                        xs.append(s[1])
                        ys.append(r["tflops"])
            if xs:
                width = 2.6 if impl == "project" else 1.3
                ax.plot(xs, ys, marker=markers[n % len(markers)], color=f"C{n % 10}", linewidth=width, label=impl)
        ax.set_xscale("log", base=2)
        ax.set_xticks(list(SWEEP_TS))
        ax.set_xticklabels([str(t) for t in SWEEP_TS])
        ax.set_xlabel("T (sequence length), B·T = %d" % SWEEP_TOKENS)
        ax.set_ylabel("TFLOP/s (causal FLOPs)")
        ax.set_title(f"{dtype_name}, Hq={SWEEP_HEADS[0]}, Hkv={SWEEP_HEADS[1]}, D={SWEEP_HEADS[2]}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(f"Causal GQA forward, back_to_back median: {result['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def write_reports(result: dict, means: dict, info: dict, paths, log) -> None:
    """Write the markdown report and, where there is sweep data, the plot; paths: (json, md, png)."""
    json_path, md_path, png_path = paths
    md_path.write_text(render_md(result, means, info))
    plotted = False
    try:
        plotted = render_plot(result, info["sweep_shapes"], png_path)
    except Exception as e:
        log(f"plot failed: {format_error(e)}")
    log(f"wrote {json_path}, {md_path}" + (f", {png_path}" if plotted else " (no sweep data, no plot)"))
