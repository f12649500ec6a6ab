# Run: python3 bench/ws_protocol_model.py (no GPU; about 1 s).
"""Model of ws/kernel.cuh's synchronisation (persistent): per stage mbarriers full_k, full_v (TMA,
count 1), ready (scanners, 96), free_k, free_v (consumers, 128 C); full_q (1) and free_q (128 C)
for Q when the producer loads it (q_tma), else a barrier among the consumers around their own Q
copy; named barriers 2 .. 2 + C - 1 for the turns. A CTA walks several tiles (n_kv each) and the
K/V ring runs on across them. Generators under a random scheduler; checks deadlock, that a tile
(Q, K, V) is read only after it landed (V after its scan) and only while it is in place, that a
slot is refilled only after every consumer freed what was there, and that the turn barriers end
balanced."""
import random

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

def run(tiles, S, C, pingpong, overlap, q_tma, seed):
    rng = random.Random(seed)
    full_k = [MBar(1) for _ in range(S)]; full_v = [MBar(1) for _ in range(S)]
    ready = [MBar(96) for _ in range(S)]
    free_k = [MBar(128 * C) for _ in range(S)]; free_v = [MBar(128 * C) for _ in range(S)]
    full_q, free_q = MBar(1), MBar(128 * C)
    k_tile = [None] * S; v_tile = [None] * S; scanned = [None] * S
    k_readers = [set() for _ in range(S)]; v_readers = [set() for _ in range(S)]
    q = {"tile": None, "readers": set(range(C))}
    named = {2 + w: [0, 0, []] for w in range(C)}
    csync = {"count": 0, "gen": 0}

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
    def consumers_sync():
        gen = csync["gen"]; csync["count"] += 1
        if csync["count"] == C:
            csync["count"] = 0; csync["gen"] += 1
        while csync["gen"] == gen:
            yield

    def producer():
        def load(kind, step):
            st = step % S
            free, full, slots, readers = (free_k, full_k, k_tile, k_readers) if kind == "k" else (free_v, full_v, v_tile, v_readers)
            if step >= S:
                while not free[st].done((step // S - 1) & 1):
                    yield
                assert readers[st] == set(range(C)), (kind, step, readers[st])
            slots[st] = None; readers[st] = set()
            if kind == "v": scanned[st] = None
            yield
            slots[st] = step
            full[st].arrive()
            yield
        it = 0
        for tc, n_kv in enumerate(tiles):
            yield from load("k", it)
            if q_tma:
                if tc > 0:
                    while not free_q.done((tc - 1) & 1):
                        yield
                assert q["readers"] == set(range(C)), ("q", tc, q["readers"])
                q["tile"] = None; q["readers"] = set()
                yield
                q["tile"] = tc
                full_q.arrive()
            for n in range(n_kv):
                if n + 1 < n_kv: yield from load("k", it + n + 1)
                yield from load("v", it + n)
            it += n_kv

    def scanners():
        it = 0
        for n_kv in tiles:
            for n in range(n_kv):
                st = it % S
                while not full_v[st].done((it // S) & 1):
                    yield
                assert v_tile[st] == it
                scanned[st] = it
                ready[st].arrive(96)
                it += 1
                yield

    def consumer(wg):
        last = wg == C - 1
        nxt = 2 + (wg + 1) % C
        if pingpong and last: bar_arrive(2)
        it = 0
        for tc, n_kv in enumerate(tiles):
            more = tc + 1 < len(tiles)
            if q_tma:
                while not full_q.done(tc & 1):
                    yield
            else:
                yield from consumers_sync()
                if wg == 0:   # the copy itself: modelled once, after every consumer freed the last Q
                    assert q["readers"] == set(range(C)), ("q copy", tc, q)
                    q["tile"] = tc; q["readers"] = set()
                yield
                yield from consumers_sync()
            def wait_k(n):
                while not full_k[(it + n) % S].done(((it + n) // S) & 1):
                    yield
            def wait_v(n):
                while not ready[(it + n) % S].done(((it + n) // S) & 1):
                    yield
            def use_k(n):
                assert k_tile[(it + n) % S] == it + n, ("k", wg, it + n, k_tile)
                assert q["tile"] == tc, ("q", wg, tc, q)
            def use_v(n):
                st = (it + n) % S
                assert v_tile[st] == it + n and scanned[st] == it + n, ("v", wg, it + n, v_tile, scanned)
            def s_done(n):
                use_k(n); k_readers[(it + n) % S].add(wg); free_k[(it + n) % S].arrive(128)
                if n + 1 == n_kv:
                    q["readers"].add(wg)
                    if q_tma: free_q.arrive(128)
            def v_done(n):
                use_v(n); v_readers[(it + n) % S].add(wg); free_v[(it + n) % S].arrive(128)
            if overlap:
                yield from wait_k(0)
                if pingpong: yield from bar_sync(2 + wg)
                use_k(0)
                if pingpong: bar_arrive(nxt)
                yield
                s_done(0)
                for n in range(n_kv - 1):
                    yield from wait_k(n + 1)
                    yield from wait_v(n)
                    use_v(n)
                    if pingpong: yield from bar_sync(2 + wg)
                    use_k(n + 1); use_v(n)
                    if pingpong: bar_arrive(nxt)
                    yield
                    s_done(n + 1)
                    yield
                    v_done(n)
                yield from wait_v(n_kv - 1)
                if pingpong: yield from bar_sync(2 + wg)
                use_v(n_kv - 1)
                if pingpong and (not last or more): bar_arrive(nxt)
                yield
                v_done(n_kv - 1)
            else:
                for n in range(n_kv):
                    yield from wait_k(n)
                    if pingpong: yield from bar_sync(2 + wg)
                    use_k(n)
                    if pingpong: bar_arrive(nxt)
                    yield
                    s_done(n)
                    yield from wait_v(n)
                    if pingpong: yield from bar_sync(2 + wg)
                    use_v(n)
                    if pingpong and (not last or n + 1 < n_kv or more): bar_arrive(nxt)
                    yield
                    v_done(n)
            it += n_kv

    actors = [producer(), scanners()] + [consumer(w) for w in range(C)]
    alive = list(range(len(actors)))
    steps = 0
    while alive:
        steps += 1
        if steps > 400000:
            raise AssertionError("deadlock tiles=%s S=%d C=%d pp=%s ov=%s q_tma=%s" % (tiles, S, C, pingpong, overlap, q_tma))
        i = rng.choice(alive)
        try:
            next(actors[i])
        except StopIteration:
            alive.remove(i)
    assert all(v[0] == 0 for v in named.values()), named

if __name__ == "__main__":
    count = 0
    rng = random.Random(1)
    for C in (2, 3):
        for S in (2, 3, 4):
            for pp in (False, True):
                for ov in (False, True):
                    for q_tma in (False, True):
                        for seed in range(40):
                            tiles = [rng.randint(1, 9) for _ in range(rng.randint(1, 4))]
                            run(tiles, S, C, pp, ov, q_tma, seed); count += 1
    print("ok", count, "runs")
