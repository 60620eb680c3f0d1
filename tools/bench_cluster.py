"""The real cluster on this machine, one process per peer, replaying a workload slice at a fixed Poisson rate
under the three policies (pc, local-pic, nebula): TTFT P50/P99 and CHR, as ratios against pc.

    python tools/bench_cluster.py [--num-requests 48] [--qps 1.0] [--prefill-workers 2] [--decode-workers 1] ...

The same command as `nebula-engine compare` (the repo's main job), with the same options and defaults; NIXL
page throughput is tools/bench_transfer.py.
"""

from __future__ import annotations

from nebula_engine.cli.compare import compare

if __name__ == "__main__":
    compare(prog_name="bench_cluster.py")
