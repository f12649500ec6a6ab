"""Build every kernel unit of this checkout at once, one nvcc per unit in parallel (the library
builds them one at a time on first use; a fresh machine spends minutes there before the tests,
the sanitizer or the benchmark time anything).

    python3 bench/build_units.py

It asks the library which units its plans use (the loader is replaced by a recorder in this
process, so nothing is loaded here), starts the builder on each one not yet built, and waits.
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import gqa_module  # noqa: E402


def main():
    start = time.time()
    ops = gqa_module.load_extension()
    units = set()

    def record(unit, dtype, width, sm90a=False):
        units.add((unit, dtype, width, sm90a))
        return 1   # a non-null address: the plan counts as loaded, and nothing calls it

    gqa_module.load_unit = record
    ops._load_every_plan.default()
    files = gqa_module._read_kernel_files()
    builders = []
    for unit, dtype, width, sm90a in sorted(units):
        library = gqa_module._unit_library(unit.split("/")[0], unit, dtype, width, sm90a,
                                           ops._gqa_build_id, ops._gqa_targets, files)
        if not os.path.exists(library["path"]):
            builders.append((unit, gqa_module._start_builder({"library": library})))
    failed = [unit for unit, builder in builders if builder.wait() != 0]
    print("%d units, %d built, %d failed %s, %.1f s" % (len(units), len(builders), len(failed), failed,
                                                       time.time() - start))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
