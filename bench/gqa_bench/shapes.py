"""The shapes a run measures, (B, T, Hq, Hkv, D), and the plan built from the command line."""
from .config import BACKWARD_MODE, MODES

HARNESS_SHAPE = (2, 80, 8, 2, 32)
SCALE_CONFIGS = (
    ((4, 1024, 32, 8, 128), ("float32", "bfloat16", "float16")),
    ((1, 8192, 32, 8, 128), ("float32", "bfloat16", "float16")),
    ((16, 2048, 32, 8, 64), ("float32", "bfloat16", "float16")),
    ((1, 32768, 32, 8, 128), ("bfloat16", "float16", "float32")),
    ((2, 4096, 16, 4, 256), ("bfloat16", "float16")),
)
QUICK_CONFIGS = (((4, 1024, 32, 8, 128), ("float32", "bfloat16")),)
SWEEP_TS = (512, 1024, 2048, 4096, 8192, 16384, 32768)
SWEEP_TOKENS = 32768  # B * T for every sweep point
SWEEP_HEADS = (32, 8, 128)  # Hq, Hkv, D
SWEEP_DTYPES = ("float32", "bfloat16")


def flops_of(shape) -> float:
    """Causal attention FLOPs: 4·B·Hq·T²·D/2."""
    B, T, Hq, _, D = shape
    return 4.0 * B * Hq * T * T * D / 2.0


def shape_str(shape) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ")"


def build_plan(args):
    """Return [(shape, dtype, modes)], and the sweep shapes per dtype."""
    plan = [(HARNESS_SHAPE, "float32", MODES)]
    seen = {(HARNESS_SHAPE, "float32")}
    sweep_shapes: dict = {}

    def add(shape, dtype_name, modes=("back_to_back",)):
        if (shape, dtype_name) not in seen:
            seen.add((shape, dtype_name))
            plan.append((shape, dtype_name, modes))

    scale_modes = ("back_to_back", BACKWARD_MODE) if getattr(args, "backward", False) else ("back_to_back",)
    for shape, dtypes in QUICK_CONFIGS if args.quick else SCALE_CONFIGS:
        for d in dtypes:
            add(shape, d, scale_modes)
    if not args.quick and not args.no_sweep:
        dtypes = SWEEP_DTYPES + (("float16",) if args.sweep_fp16 else ())
        for d in dtypes:
            shapes = []
            for T in SWEEP_TS:
                shape = (SWEEP_TOKENS // T, T) + SWEEP_HEADS[:2] + (SWEEP_HEADS[2],)
                shapes.append(shape)
                add(shape, d)
            sweep_shapes[d] = shapes
    dtypes_only = getattr(args, "dtypes", None)
    if dtypes_only:
        plan = [step for step in plan if step[1] in dtypes_only]
        sweep_shapes = {d: shapes for d, shapes in sweep_shapes.items() if d in dtypes_only}
    return plan, sweep_shapes
