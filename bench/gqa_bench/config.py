"""Settings of a run: timing modes, dtypes, tolerances, memory limits and trial counts."""
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_OUT = REPO_ROOT / "bench" / "results"

MODES = ("harness", "back_to_back", "graph")
# Backward rows (--backward): forward + backward minus forward, back to back; FLOPs counted as 2.5x
# the forward's (FlashAttention's convention); the implementations that train.
BACKWARD_MODE = "backward"
ALL_MODES = MODES + (BACKWARD_MODE,)
BACKWARD_FLOP_FACTOR = 2.5
BACKWARD_IMPLS = ("project", "sdpa_expand_efficient", "sdpa_flash", "sdpa_cudnn", "fa4", "fa4_deterministic")
# The modes --rounds repeats: every implementation of a shape timed once a round, in turn, so that a
# drift of the card's clock between implementations reaches them all alike.
ROUND_MODES = ("back_to_back", BACKWARD_MODE)
DTYPE_NAMES = ("float32", "bfloat16", "float16")

TOLERANCE = {"float32": 1e-3, "bfloat16": 2e-2, "float16": 2e-2}
FULL_REFERENCE_LIMIT = 4 * 2**30  # bytes of float64 T x T scores
SLICE_ROWS = 128  # first and last query rows used when the reference is sliced
MEMORY_FRACTION = 0.6  # an impl may use at most this share of free memory
FLUSH_BYTES = 256 * 2**20

HARNESS_WARMUP, HARNESS_TRIALS = 3, 100
LOOPS_WARMUP, LOOPS_TRIALS = 1, 5  # reference_loops takes ~100 ms a call
GRAPH_CALLS, GRAPH_REPLAYS = 20, 10
LOOPS_GRAPH_CALLS, LOOPS_GRAPH_REPLAYS = 2, 3
