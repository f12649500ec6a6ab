# Run: python3 bench/ws_protocol_model.py (no GPU; about 2 s).
"""Model of ws/kernel.cuh's synchronisation with K and V freed separately: per stage mbarriers
full_k, full_v (TMA, count 1), ready (scanners, 96), free_k, free_v (consumers, 128 C); named
barriers 2 .. 2 + C - 1 for the turns. Generators under a random scheduler; checks deadlock,
that a tile is read only after it landed (and V after its scan), that a slot is refilled only
after every consumer freed the tile before, and that the turn barriers end balanced."""
import random, sys

class MBar:
    def __init__(self, count):
        self.count, self.pending, self.phase = count, count, 0
    def arrive(self, k=1):
        for _ in range(k):
            self.pending -= 1
            assert self.pending >= 0
            if self.pending == 0:
                self.phase += 1
                self.pending = self.count
    def done(self, parity):
        return (self.phase & 1) != parity

def run(n_kv, S, C, pingpong, overlap, seed):
    rng = random.Random(seed)
    full_k = [MBar(1) for _ in range(S)]; full_v = [MBar(1) for _ in range(S)]
    ready = [MBar(96) for _ in range(S)]
    free_k = [MBar(128 * C) for _ in range(S)]; free_v = [MBar(128 * C) for _ in range(S)]
    k_tile = [None] * S; v_tile = [None] * S; scanned = [None] * S
    k_readers = [set() for _ in range(S)]; v_readers = [set() for _ in range(S)]
    named = {2 + w: [0, 0, []] for w in range(C)}

    def bar_sync(bid):
        nb = named[bid]; nb[0] += 128; nb[2].append("sync"); gen = nb[1]
        if nb[0] == 256:
            assert sorted(nb[2]) == ["arrive", "sync"]; nb[0] = 0; nb[1] += 1; nb[2] = []
        while nb[1] == gen:
            yield
    def bar_arrive(bid):
        nb = named[bid]; nb[0] += 128; nb[2].append("arrive")
        if nb[0] == 256:
            assert sorted(nb[2]) == ["arrive", "sync"]; nb[0] = 0; nb[1] += 1; nb[2] = []
        assert nb[0] <= 256

    def producer():
        def load(kind, n):
            st = n % S
            free, full, tiles, readers = (free_k, full_k, k_tile, k_readers) if kind == "k" else (free_v, full_v, v_tile, v_readers)
            if n >= S:
                while not free[st].done((n // S - 1) & 1):
                    yield
                assert readers[st] == set(range(C)), (kind, n, readers[st])
            tiles[st] = None; readers[st] = set()
            if kind == "v": scanned[st] = None
            yield
            tiles[st] = n
            full[st].arrive()
            yield
        yield from load("k", 0)
        for n in range(n_kv):
            if n + 1 < n_kv: yield from load("k", n + 1)
            yield from load("v", n)

    def scanners():
        for n in range(n_kv):
            st = n % S
            while not full_v[st].done((n // S) & 1):
                yield
            assert v_tile[st] == n
            scanned[st] = n
            ready[st].arrive(96)
            yield

    def consumer(wg):
        def wait_k(n):
            while not full_k[n % S].done((n // S) & 1):
                yield
        def wait_v(n):
            while not ready[n % S].done((n // S) & 1):
                yield
        def use_k(n):
            assert k_tile[n % S] == n, ("k", wg, n, k_tile)
        def use_v(n):
            assert v_tile[n % S] == n and scanned[n % S] == n, ("v", wg, n, v_tile, scanned)
        def free_k_(n):
            use_k(n); k_readers[n % S].add(wg); free_k[n % S].arrive(128)
        def free_v_(n):
            use_v(n); v_readers[n % S].add(wg); free_v[n % S].arrive(128)
        last = wg == C - 1
        nxt = 2 + (wg + 1) % C
        if pingpong and last: bar_arrive(2)
        if overlap:
            yield from wait_k(0)
            if pingpong: yield from bar_sync(2 + wg)
            use_k(0)
            if pingpong: bar_arrive(nxt)
            yield
            free_k_(0)
            for n in range(n_kv - 1):
                yield from wait_k(n + 1)
                yield from wait_v(n)
                use_v(n)
                if pingpong: yield from bar_sync(2 + wg)
                use_k(n + 1); use_v(n)
                if pingpong: bar_arrive(nxt)
                yield
                free_k_(n + 1)
                yield
                free_v_(n)
            yield from wait_v(n_kv - 1)
            if pingpong: yield from bar_sync(2 + wg)
            use_v(n_kv - 1)
            if pingpong and not last: bar_arrive(nxt)
        else:
            for n in range(n_kv):
                yield from wait_k(n)
                if pingpong: yield from bar_sync(2 + wg)
                use_k(n)
                if pingpong: bar_arrive(nxt)
                yield
                free_k_(n)
                yield from wait_v(n)
                if pingpong: yield from bar_sync(2 + wg)
                use_v(n)
                if pingpong and (not last or n + 1 < n_kv): bar_arrive(nxt)
                yield
                free_v_(n)

    actors = [producer(), scanners()] + [consumer(w) for w in range(C)]
    alive = list(range(len(actors)))
    steps = 0
    while alive:
        steps += 1
        if steps > 200000:
            raise AssertionError("deadlock n_kv=%d S=%d C=%d pp=%s ov=%s" % (n_kv, S, C, pingpong, overlap))
        i = rng.choice(alive)
        try:
            next(actors[i])
        except StopIteration:
            alive.remove(i)
    assert all(v[0] == 0 for v in named.values()), named

count = 0
for C in (2, 3):
    for S in (2, 3, 4):
        for n_kv in range(1, 18):
            for pp in (False, True):
                for ov in (False, True):
                    for seed in range(15):
                        run(n_kv, S, C, pp, ov, seed); count += 1
print("ok", count, "runs")
