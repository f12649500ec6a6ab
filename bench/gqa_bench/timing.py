"""CUDA-event timing in the three modes: harness (KernelBench's method), back_to_back and graph."""
import statistics

from .config import (
    BACKWARD_MODE,
    FLUSH_BYTES,
    GRAPH_CALLS,
    GRAPH_REPLAYS,
    HARNESS_TRIALS,
    HARNESS_WARMUP,
    LOOPS_GRAPH_CALLS,
    LOOPS_GRAPH_REPLAYS,
    LOOPS_TRIALS,
    LOOPS_WARMUP,
)


class Timer:
    """Times fn(*args) in milliseconds per call; owns the buffer that flushes the L2 cache."""

    def __init__(self, torch):
        self.torch = torch
        try:
            from triton.testing import do_bench

            self.do_bench = do_bench
            self.do_bench_note = "triton.testing.do_bench"
        except Exception:  # the note keeps the wording of earlier reports
            self.do_bench = self._fallback_do_bench
            self.do_bench_note = "in-file copy of do_bench's method (triton not importable)"
        self.flush = torch.empty(FLUSH_BYTES, dtype=torch.int8, device="cuda")

    def time(self, mode, fn, args, name):
        """Return (median ms, mean ms or None) of fn(*args) in `mode`."""
        if mode == "harness":
            return self.time_harness(fn, args, name)
        if mode == "back_to_back":
            return float(self.do_bench(lambda: fn(*args), return_mode="median")), None
        if mode == BACKWARD_MODE:
            return self.time_backward(fn, args), None
        return self.time_graph(fn, args, name), None

    def _elapsed_ms(self, fn, *args):
        """Milliseconds between two events around fn(*args), synchronized."""
        torch = self.torch
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)

    def time_backward(self, fn, args):
        """The backward alone: the median of forward + backward (inputs that require grad, a fixed
        output gradient) minus the median of the forward with the same inputs, both by do_bench."""
        torch = self.torch
        leaves = [a.detach().clone().requires_grad_(True) for a in args]
        grad = torch.randn_like(args[0])

        def forward():
            return fn(*leaves)

        def forward_backward():
            for leaf in leaves:
                leaf.grad = None
            fn(*leaves).backward(grad)

        with torch.enable_grad():
            both = float(self.do_bench(forward_backward, return_mode="median"))
            alone = float(self.do_bench(forward, return_mode="median"))
        return both - alone

    def time_harness(self, fn, args, name):
        """Median and mean over trials of: synchronize, flush L2, one call between two events."""
        torch = self.torch
        warm, trials = (LOOPS_WARMUP, LOOPS_TRIALS) if name == "reference_loops" else (HARNESS_WARMUP, HARNESS_TRIALS)
        for _ in range(warm):
            fn(*args)
        torch.cuda.synchronize()
        times = []
        for _ in range(trials):
            torch.cuda.synchronize()
            self.flush.zero_()
            times.append(self._elapsed_ms(fn, *args))
        return statistics.median(times), statistics.fmean(times)

    def time_graph(self, fn, args, name):
        """Median over replays of one CUDA graph of many calls, divided by the calls; no flush."""
        torch = self.torch
        calls, replays = (LOOPS_GRAPH_CALLS, LOOPS_GRAPH_REPLAYS) if name == "reference_loops" else (GRAPH_CALLS, GRAPH_REPLAYS)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                fn(*args)
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                for _ in range(calls):
                    last = fn(*args)
            graph.replay()
            torch.cuda.synchronize()
            per_call = [self._elapsed_ms(graph.replay) / calls for _ in range(replays)]
            del last
            return statistics.median(per_call)
        finally:
            del graph

    def _fallback_do_bench(self, fn, warmup=25, rep=100, return_mode="median"):
        """triton.testing.do_bench's method: estimate the call time, warm up for `warmup` ms, then
        time about `rep` ms of calls one by one, each after an L2 flush."""
        torch = self.torch
        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(5):
            self.flush.zero_()
            fn()
        end.record()
        torch.cuda.synchronize()
        est = max(start.elapsed_time(end) / 5, 1e-4)
        for _ in range(max(1, int(warmup / est))):
            fn()
        n = max(1, int(rep / est))
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(n)]
        for i in range(n):
            self.flush.zero_()
            starts[i].record()
            fn()
            ends[i].record()
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends))
